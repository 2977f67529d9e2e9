"""One regression test per upstream control-protocol bug, replayed on real endpoints.

Numbers are sgl-project/sglang issue or pull-request numbers of SGLang's PD-disaggregation staging buffer; each
test says what went wrong there.

#29984 (concurrent sends on one socket) and #26501 (CUDA-only events) live below the protocol, in runtime/ and
dataplane/, and are tested there.
"""

from __future__ import annotations

import msgspec
import pytest
from protocol_harness import (
    all_quiescent,
    attach,
    compute,
    expect,
    full_room,
    inject,
    make_pump,
    sent,
)

from kvstage.errors import ProtocolError
from kvstage.layout import plan_staging
from kvstage.protocol import (
    AbortRoom,
    Codec,
    ComputeScheduled,
    DecodeEndpoint,
    PrefillEndpoint,
    Scatter,
    Send,
    SendFailed,
    WriteRegion,
    reasons,
)
from kvstage.protocol.messages import (
    MAX_CHUNKS,
    PROTOCOL_VERSION,
    AbortAck,
    ChunkReady,
    Grant,
    GrantRefused,
    Heartbeat,
    StagingRequest,
)

CHUNK_BYTES = 4096  # one 8-token chunk of the default layout on d0 (H=8, P=2, D=1)


def ring_of(pump) -> object:
    ep = pump.endpoints["d0"]
    assert isinstance(ep, DecodeEndpoint)
    return ep.ring


def test_31217_aborted_room_releases_its_staging_so_later_rooms_are_not_wedged() -> None:
    pump = make_pump(ring_bytes=2 * CHUNK_BYTES)
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    compute(pump, 1, 8)  # chunk 0 is written and scattered
    for writer in ("p0", "p1"):
        pump.call(writer, ComputeScheduled(1, 16))  # chunk 1 is granted, then the request is aborted
    pump.run()
    assert ring_of(pump).num_live == 1
    pump.call("d0", AbortRoom(1))
    pump.run()
    assert ring_of(pump).num_live == 0
    for room in range(2, 12):  # every later room wraps through the space room 1 held
        full_room(pump, room, 16)
        assert pump.outcome("d0", room) == "ok"
    assert all_quiescent(pump)


def test_31217_staging_request_for_an_unregistered_room_is_refused_not_dropped() -> None:
    pump = make_pump()
    refusal = sent(inject(pump, "d0", "p0", StagingRequest(room=5, chunk=0)), GrantRefused)
    assert refusal == [GrantRefused(room=5, chunk=0, reason=reasons.UNKNOWN_ROOM)]


def test_31217_failed_chunk_ready_send_fails_the_room_instead_of_being_swallowed() -> None:
    pump = make_pump()
    pump.drop = lambda src, dst, env: isinstance(env.body, ChunkReady) and src == "p1"
    full_room(pump, 1, 8)
    notice = next(
        a for src, a in pump.log if src == "p1" and isinstance(a, Send) and isinstance(a.envelope.body, ChunkReady)
    )
    pump.call("p1", SendFailed("d0", notice.envelope, "socket closed"))
    pump.drop = None
    pump.advance(3.0)
    assert pump.outcome("p1", 1) == reasons.SEND_FAILED
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_PREFILL
    assert all_quiescent(pump)


def test_31217_oversized_chunk_fails_its_room_with_no_fallback_and_the_rank_keeps_serving() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES - 1)
    full_room(pump, 1, 8)
    assert pump.outcome("d0", 1) == reasons.STAGING_OVERSIZED
    assert not [a for _, a in pump.log if isinstance(a, WriteRegion)]
    full_room(pump, 2, 4)
    assert pump.outcome("d0", 2) == "ok"


def test_30545_prefix_hit_longer_than_one_grid_slot_is_cut_into_grid_slots() -> None:
    pump = make_pump()
    expect(pump, 1, 44, prefix=12)
    attach(pump, 1, 44)
    compute(pump, 1, 44)  # everything (e.g. a prefill-side prefix hit) is ready at once
    pump.run()
    writes = sorted((a.chunk, a.num_tokens, a.region.nbytes) for a in pump.actions_of("p0", WriteRegion))
    layout = pump.endpoints["d0"].config.layout
    expected = [
        (i, min(8, 32 - 8 * i), plan_staging(layout, 2, 1, 0, min(8, 32 - 8 * i)).total_bytes) for i in range(4)
    ]
    assert writes == expected
    first = min(pump.actions_of("p0", WriteRegion), key=lambda a: a.chunk)
    assert first.src_pages == (50_000 + 1000 + 3, 50_000 + 1000 + 4)  # tokens 12..20 at page size 4
    assert pump.outcome("d0", 1) == "ok"


def test_37166_grant_after_the_ring_empties_is_writable_at_once() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES + CHUNK_BYTES // 2)
    full_room(pump, 1, 6)  # 3072 bytes at [0, 3072), then freed: the ring is empty
    full_room(pump, 2, 8)  # 4096 bytes do not fit the tail: a new round at offset 0, ready at once
    assert pump.outcome("d0", 2) == "ok"
    prefill = pump.endpoints["p0"]
    assert isinstance(prefill, PrefillEndpoint) and prefill.parked_count() == 0


def test_29978_lost_grant_is_retried_and_the_room_completes() -> None:
    pump = make_pump()
    lost = []
    pump.drop = lambda src, dst, env: isinstance(env.body, Grant) and not lost and not lost.append(env)
    full_room(pump, 1, 16)
    pump.advance(2.0)
    assert lost and pump.outcome("d0", 1) == "ok"
    assert pump.endpoints["p0"].stats.retries + pump.endpoints["p1"].stats.retries >= 1


def test_29978_lost_watermark_does_not_stall_a_parked_chunk() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES + CHUNK_BYTES // 2)
    pump.hold = lambda src, a: isinstance(a, Scatter) and a.room == 1
    full_room(pump, 1, 8)
    full_room(pump, 2, 8)
    pump.drop = lambda src, dst, env: src == "d0" and isinstance(env.body, Heartbeat) and pump.now < 0.1
    pump.release_held()
    pump.advance(2.0)
    assert pump.outcome("d0", 2) == "ok"


@pytest.mark.parametrize("crashed", ["p1.0", "p1.1"])
def test_36049_34737_dead_subscriber_is_pruned_and_never_sent_to_again(crashed: str) -> None:
    pump = make_pump(prefill_instances=2)
    full_room(pump, 1, 8, instance=1)
    pump.endpoints.pop(crashed)
    pump.advance(5.0)
    cutoff = len(pump.log)
    full_room(pump, 2, 8)
    pump.advance(10.0)
    assert crashed not in pump.endpoints["d0"].peers()
    assert not [a for _, a in pump.log[cutoff:] if isinstance(a, Send) and a.peer == crashed]


def test_37697_chunks_arriving_out_of_order_still_complete_the_room() -> None:
    pump = make_pump()
    pump.hold = lambda src, a: isinstance(a, WriteRegion)
    full_room(pump, 1, 24)
    pump.held.sort(key=lambda item: (-item[1].chunk, item[0]))
    pump.release_held()
    pump.run()
    assert pump.outcome("d0", 1) == "ok"


def test_36707_abort_is_not_acknowledged_while_a_write_can_still_land() -> None:
    pump = make_pump()
    pump.hold = lambda src, a: isinstance(a, WriteRegion) and src == "p1"
    full_room(pump, 1, 8)
    pump.call("d0", AbortRoom(1))
    pump.run()
    acks = [src for src, a in pump.log if isinstance(a, Send) and isinstance(a.envelope.body, AbortAck)]
    assert acks == ["p0"]
    assert ring_of(pump).num_live == 1
    pump.release_held()
    pump.run()
    assert ring_of(pump).num_live == 0


def test_39764_chunk_index_from_the_wire_is_bounded_and_never_allocates() -> None:
    pump = make_pump()
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, "p0", 1, 0, 1, None, ["stage_req", 1, 2**40]])
    with pytest.raises(ProtocolError):
        Codec().decode(frame)
    expect(pump, 1, 16)
    for chunk in (2, 100, MAX_CHUNKS - 1):  # inside the wire bound, outside the room
        inject(pump, "d0", "p0", StagingRequest(room=1, chunk=chunk))
        inject(pump, "d0", "p0", ChunkReady(room=1, chunk=chunk, epoch=0))
    assert ring_of(pump).num_live == 0
    assert pump.endpoints["d0"].stats.messages_rejected["chunk index out of range"] == 6
