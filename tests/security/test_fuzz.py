"""Hypothesis over the wire decoder, the frame authenticator and both endpoints (issue #15, item 4).

Frames are random bytes, valid-looking envelopes with fields far outside their bounds (huge or negative indices
and sizes, wrong epochs and versions, unknown rooms, forged senders), and mutations of valid frames (truncated,
extended, bytes flipped, replayed, signed with the wrong key). Properties: the codec raises nothing but
`ProtocolError`; `FrameAuth.open` refuses every frame it did not seal unchanged; an endpoint fed any of them
raises nothing, tracks at most `Limits.max_peers` peers and never holds a room its engine did not open.
Together the tests run 12,000 examples (CI keeps them under a minute); `KVSTAGE_FUZZ_EXAMPLES` scales each (a long
run needs pytest's `--timeout=0`: the suite stops any test after 300 s).
"""

from __future__ import annotations

import os

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstage.errors import ProtocolError
from kvstage.layout import KVLayout
from kvstage.protocol import (
    AttachRoom,
    Codec,
    DecodeConfig,
    DecodeEndpoint,
    ExpectRoom,
    Limits,
    PrefillConfig,
    PrefillEndpoint,
    ReceivedFrame,
    Tick,
    Timing,
)
from kvstage.protocol.messages import PROTOCOL_VERSION, Envelope, Heartbeat, StagingRequest
from kvstage.transport.auth import REJECT_AUTH, FrameAuth

SCALE = float(os.environ.get("KVSTAGE_FUZZ_EXAMPLES", "1"))
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=4)
TIMING = Timing(heartbeat_s=0.5, dead_after_s=3.0, retry_initial_s=0.05, retry_max_s=0.4)
LIMITS = Limits(max_peers=32, max_rooms_per_peer=16, max_closed_rooms=64)
CODEC = Codec(1 << 16)
SECRET = b"fuzzing secret of thirty-two b!!"
TAGS = ["hb", "fenced", "meta", "meta_ack", "stage_req", "grant", "refused", "ready", "ready_ack", "abort",
        "abort_ack"]  # fmt: skip


def _examples(n: int) -> settings:
    return settings(max_examples=int(n * SCALE), deadline=None, suppress_health_check=list(HealthCheck))


wild_ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.integers(-5, 70_000), st.sampled_from([0, 1, 2**16, 2**63 - 1])
)
wild_values = st.one_of(wild_ints, st.text(max_size=8), st.binary(max_size=8), st.none(), st.booleans(),
                        st.lists(wild_ints, max_size=6))  # fmt: skip
senders = st.sampled_from(["P/0", "P/1", "D/0", "x-hostile", "", "P/0" * 100])
rooms = st.one_of(st.sampled_from([1, 2]), wild_ints)


@st.composite
def raw_envelopes(draw: st.DrawFn) -> bytes:
    """msgpack of an envelope-shaped array with any field values (bypassing the codec's checks)."""
    body = [draw(st.sampled_from(TAGS)), draw(rooms), *draw(st.lists(wild_values, max_size=8))]
    version = draw(st.one_of(st.just(PROTOCOL_VERSION), wild_ints))
    watermark = draw(st.one_of(st.none(), st.lists(wild_ints, max_size=3)))
    fields = [version, draw(senders), draw(wild_ints), draw(wild_ints), draw(wild_ints), watermark, body]
    return msgspec.msgpack.encode(fields[: draw(st.integers(0, len(fields)))] if draw(st.booleans()) else fields)


@st.composite
def valid_frames(draw: st.DrawFn) -> bytes:
    body = draw(st.sampled_from([
        Heartbeat(), StagingRequest(room=draw(st.sampled_from([1, 2, 3])), chunk=draw(st.integers(0, 2**16 - 1))),
    ]))  # fmt: skip
    session = draw(st.integers(0, 2**63 - 1))
    epoch = draw(st.integers(0, 2**32))
    return CODEC.encode(Envelope(PROTOCOL_VERSION, draw(senders.filter(bool).filter(lambda s: len(s) < 64)), session,
                                 epoch, draw(st.integers(0, 2**32)), None, body))  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    frame = bytearray(draw(frames))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 2))
        if kind == 0 and frame:
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
        elif kind == 1:
            del frame[draw(st.integers(0, len(frame))) :]
        else:
            frame += draw(st.binary(max_size=16))
    return bytes(frame)


hostile_frames = st.one_of(st.binary(max_size=96), raw_envelopes(), valid_frames(), mutated(valid_frames()),
                           mutated(raw_envelopes()), st.just(b"\xdd\xff\xff\xff\xff"))  # fmt: skip


@_examples(4000)
@given(hostile_frames)
def test_the_codec_decodes_or_refuses_any_bytes_with_protocol_error_only(frame: bytes) -> None:
    try:
        envelope = CODEC.decode(frame)
    except ProtocolError:
        return
    assert CODEC.decode(CODEC.encode(envelope)) == envelope


SEALER, OPENER = FrameAuth(SECRET), FrameAuth(SECRET)
FORGER = FrameAuth(b"the wrong key, also thirty-two b")


@_examples(2000)
@given(valid_frames(), st.integers(0, 3), st.data())
def test_only_frames_sealed_unchanged_with_the_secret_open_and_only_once(payload: bytes, how: int, data) -> None:
    sealed = SEALER.seal(payload, b"tcp://decode:1")
    if how == 0:
        opened = OPENER.open(sealed, b"tcp://decode:1")
        assert not isinstance(opened, str) and opened.payload == payload
        assert OPENER.open(sealed, b"tcp://decode:1") == "replay"
    elif how == 1:
        assert OPENER.open(FORGER.seal(payload, b"tcp://decode:1"), b"tcp://decode:1") == REJECT_AUTH
    elif how == 2:
        assert OPENER.open(sealed, b"tcp://another:1") == REJECT_AUTH
    else:
        changed = data.draw(mutated(st.just(sealed)).filter(lambda f: f != sealed))
        assert OPENER.open(changed, b"tcp://decode:1") == REJECT_AUTH


class Endpoints:
    """One decode and one prefill endpoint, each with a room its engine opened, fed frames for the whole run."""

    def __init__(self) -> None:
        self.now = 0.0
        self.decode = DecodeEndpoint(DecodeConfig("D/0", LAYOUT, 1, 0, 8, 1 << 16, timing=TIMING, limits=LIMITS), 1)
        self.decode.handle(ExpectRoom(1, ("P/0", "P/1"), 24, 0, (0, 1, 2, 3, 4, 5), 1e9), 0.0)
        self.prefill = PrefillEndpoint(PrefillConfig("P/0", LAYOUT, 2, 0, TIMING, LIMITS), 1)
        self.prefill.handle(AttachRoom(1, 24, 1, 1e9), 0.0)

    def feed(self, frame: bytes) -> None:
        self.now += 0.01
        for endpoint, engine_rooms in ((self.decode, {1}), (self.prefill, {1})):
            endpoint.handle(ReceivedFrame(frame), self.now)
            endpoint.handle(Tick(), self.now)
            assert len(endpoint.peers()) <= LIMITS.max_peers
            assert endpoint.open_rooms() <= engine_rooms, "a frame opened a room the engine never asked for"


ENDPOINTS = Endpoints()


@_examples(6000)
@given(hostile_frames)
def test_both_endpoints_take_any_frame_without_raising_or_growing_past_their_limits(frame: bytes) -> None:
    ENDPOINTS.feed(frame)
