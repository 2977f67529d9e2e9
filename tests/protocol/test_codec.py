"""Codec bounds: every malformed, oversized or out-of-range frame raises ProtocolError, and endpoints count it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_harness import full_room, make_pump

from kvstage.errors import ProtocolError
from kvstage.protocol import Codec, ReceivedFrame
from kvstage.protocol.messages import (
    MAX_CHUNKS,
    MAX_PAGES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    ChunkAck,
    ChunkReady,
    Envelope,
    Fenced,
    Grant,
    GrantRefused,
    Heartbeat,
    Metadata,
    MetadataAck,
    StagingRequest,
    WireWatermark,
)

BODIES = [
    Heartbeat(),
    Fenced(session=3, epoch=1),
    Metadata(
        room=9,
        decode_rank=1,
        decode_tp=2,
        prefill_tp=4,
        num_tokens=100,
        prefix_tokens=16,
        chunk_tokens=32,
        page_size=16,
        path="direct",
        epoch=4,
        ttl_s=2.5,
        pages=(1, 2, 3, 4, 5, 6, 7),
    ),
    MetadataAck(room=9),
    StagingRequest(room=9, chunk=2),
    Grant(room=9, chunk=2, round=1, offset=64, end=128, epoch=11),
    GrantRefused(room=9, chunk=2, reason="unknown room"),
    ChunkReady(room=9, chunk=2, epoch=11),
    ChunkAck(room=9, chunk=2),
    Abort(room=9, reason="timeout"),
    AbortAck(room=9),
]


def envelope(body: object, **overrides: object) -> Envelope:
    fields: dict[str, object] = dict(
        version=PROTOCOL_VERSION, sender="d0", session=5, epoch=0, seq=1, watermark=WireWatermark(2, 64), body=body
    )
    fields.update(overrides)
    return Envelope(**fields)  # type: ignore[arg-type]


def raw(*items: object) -> bytes:
    return msgspec.msgpack.encode(list(items))


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_every_body_round_trips_through_the_codec(body: object) -> None:
    codec = Codec()
    original = envelope(body)
    assert codec.decode(codec.encode(original)) == original


def test_frame_larger_than_the_limit_is_rejected_before_decoding() -> None:
    codec = Codec(max_frame_bytes=256)
    big = envelope(msgspec.structs.replace(BODIES[2], pages=tuple(range(1000, 1200))))
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        codec.encode(big)
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        codec.decode(Codec().encode(big))


def test_chunk_index_beyond_the_protocol_bound_is_rejected() -> None:
    frame = raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["stage_req", 9, MAX_CHUNKS])
    with pytest.raises(ProtocolError, match=r"\$\[6\]\[2\]"):
        Codec().decode(frame)


def test_negative_room_and_huge_page_list_are_rejected() -> None:
    with pytest.raises(ProtocolError):
        Codec().decode(raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["abort_ack", -1]))
    pages = list(range(MAX_PAGES + 1))
    meta = ["meta", 1, 0, 1, 1, 10, 0, 4, 4, "direct", 0, 1.0, pages]
    with pytest.raises(ProtocolError):
        Codec(max_frame_bytes=2**26).decode(raw(PROTOCOL_VERSION, "d0", 1, 0, 1, None, meta))


@pytest.mark.parametrize(
    "frame",
    [
        raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["stage_req", "nine", 0]),  # wrong type
        raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["stage_req", 9, 0, 7]),  # extra field
        raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["no_such_tag", 9]),  # unknown body
        raw(PROTOCOL_VERSION, "", 1, 0, 1, None, ["hb"]),  # empty sender
        raw(PROTOCOL_VERSION, "d0", 1, 0, 1, None, ["meta", 1, 0, 1, 1, 10, 0, 4, 4, "sideways", 0, 1.0, []]),
        raw(PROTOCOL_VERSION, "x" * 1000, 1, 0, 1, None, ["hb"]),  # sender too long
        raw(PROTOCOL_VERSION, "p0", 1, 0, 1, [1, -5], ["hb"]),  # negative watermark
        b"\xc1",  # not msgpack
        b"",
    ],
)
def test_malformed_frame_raises_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        Codec().decode(frame)


def test_frame_of_another_protocol_version_is_rejected() -> None:
    codec = Codec()
    with pytest.raises(ProtocolError, match="protocol version"):
        codec.decode(codec.encode(envelope(Heartbeat(), version=PROTOCOL_VERSION + 1)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_protocol_error_only(data: bytes) -> None:
    try:
        envelope = Codec().decode(data)
    except ProtocolError as exc:
        assert str(exc)
    else:
        assert isinstance(envelope, Envelope)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1), st.text(max_size=5), st.none(), st.booleans()),
        max_size=8,
    )
)
def test_arbitrary_msgpack_arrays_are_rejected_and_counted_unless_they_are_valid_messages(items: list[object]) -> None:
    """An endpoint never raises on junk; it counts each frame the codec refuses, and only those."""
    pump = make_pump()
    codec = Codec()
    for frame in (raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, items), msgspec.msgpack.encode(items)):
        try:
            codec.decode(frame)
        except ProtocolError:
            valid = False
        else:
            valid = True  # e.g. items == ["hb"]: a well-formed Heartbeat body
        for name in ("d0", "p0"):
            before = pump.endpoints[name].stats.frames_rejected
            pump.call(name, ReceivedFrame(frame))
            assert pump.endpoints[name].stats.frames_rejected == before + (0 if valid else 1)


def test_endpoint_counts_rejected_frames_and_keeps_serving() -> None:
    pump = make_pump()
    pump.call("d0", ReceivedFrame(b"\xc1garbage"))
    pump.call("d0", ReceivedFrame(raw(PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["stage_req", 9, MAX_CHUNKS + 5])))
    assert pump.endpoints["d0"].stats.frames_rejected == 2
    full_room(pump, 1, 20)
    assert pump.outcome("d0", 1) == "ok"
