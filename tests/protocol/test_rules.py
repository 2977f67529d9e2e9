"""One or more tests per protocol rule R1-R12 of issue 3, each named after the behaviour it proves."""

from __future__ import annotations

import itertools
import random

import pytest
from protocol_harness import (
    TIMING,
    Pump,
    all_quiescent,
    attach,
    compute,
    decode,
    decode_names,
    expect,
    full_room,
    inject,
    layout,
    make_pump,
    metadata,
    prefill,
    prefill_names,
    sends_from,
    sent,
    writes_of,
)

from kvstage.errors import ConfigError
from kvstage.protocol import (
    AbortRoom,
    ComputeScheduled,
    DecodeConfig,
    DecodeEndpoint,
    ExpectRoom,
    FencePeer,
    FenceScatter,
    KVReady,
    Limits,
    PrefillConfig,
    PrefillEndpoint,
    RoomFailed,
    Scatter,
    Send,
    SendFailed,
    WriteDirect,
    WriteRegion,
    reasons,
)
from kvstage.protocol.messages import (
    Abort,
    AbortAck,
    ChunkReady,
    Fenced,
    Grant,
    GrantRefused,
    Heartbeat,
    Metadata,
    MetadataAck,
    StagingRequest,
)
from kvstage.ring import Watermark

CHUNK_BYTES = 4096  # H=8, 2 layers, head_dim 8, bf16, 8 tokens, all heads on d0


# ---- R1 release on every terminal path ---------------------------------------------------------------------------
def test_aborted_room_releases_ring_space_and_pages_only_once_writer_confirms() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 16)
    assert decode(pump).ring.num_live == 2
    pump.call("d0", AbortRoom(1))
    pump.run()
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_DECODE
    assert pump.freed_pages("d0", 1) == [tuple(1000 + i for i in range(4))]  # staged: pages back after the fence
    assert decode(pump).ring.num_live == 2, "ring space stays quarantined while p0's writes can land"
    pump.release_held()
    pump.run()
    assert decode(pump).ring.num_live == 0
    assert pump.outcome("p0", 1) == reasons.ABORTED_BY_DECODE
    assert len(pump.freed_pages("d0", 1)) == 1
    assert all_quiescent(pump)


@pytest.mark.parametrize(
    ("reason", "ends_as"),
    [
        (reasons.INVALID_REQUEST, reasons.INVALID_REQUEST),
        ("", reasons.ABORTED_BY_PREFILL),
        ("made up", reasons.ABORTED_BY_PREFILL),
    ],
)
def test_a_prefill_abort_fails_the_room_for_its_reason_when_it_is_a_known_one(reason: str, ends_as: str) -> None:
    """The runtime fails a room "invalid request" once it refused an engine call of it; any other text, and none,
    is the engine's abort."""
    pump = make_pump()
    pump.hold = writes_of("p0")
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    pump.call("p0", AbortRoom(1, reason))
    pump.release_held()
    pump.run()
    assert pump.outcome("p0", 1) == ends_as
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_PREFILL
    assert all_quiescent(pump)


def test_release_fences_in_flight_scatter_before_freeing_ring_and_pages() -> None:
    pump = make_pump()
    pump.hold = lambda src, a: isinstance(a, Scatter | FenceScatter)
    full_room(pump, 1, 8)
    assert len(pump.held) == 1
    pump.call("d0", AbortRoom(1))
    pump.run()
    assert isinstance(pump.held[-1][1], FenceScatter)
    assert pump.freed_pages("d0", 1) == [] and decode(pump).ring.num_live == 1
    pump.release_held()
    pump.run()
    assert len(pump.freed_pages("d0", 1)) == 1 and decode(pump).ring.num_live == 0
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_DECODE
    assert all_quiescent(pump)


def test_release_is_idempotent_under_repeated_aborts_and_deadlines() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 16)
    pump.call("d0", AbortRoom(1))
    pump.call("d0", AbortRoom(1))
    inject(pump, "d0", "p1", Abort(room=1, reason="timeout"))
    inject(pump, "d0", "p1", Abort(room=1, reason="timeout"))
    pump.advance(40.0)  # past the room's deadline
    pump.release_held()
    pump.advance(41.0)
    pump.call("d0", AbortRoom(1))  # long gone: a no-op, not an error
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_DECODE  # asserts it ended exactly once
    assert len(pump.freed_pages("d0", 1)) == 1
    assert decode(pump).ring.num_live == 0
    assert all_quiescent(pump)


FAILURES = {
    "abort by decode": lambda pump: pump.call("d0", AbortRoom(1)),
    "abort by prefill": lambda pump: pump.call("p1", AbortRoom(1)),
    "timeout": lambda pump: pump.advance(31.0),
    "transfer failure": lambda pump: pump.release_held(ok=False),
    "writer crash": lambda pump: (pump.endpoints.pop("p0"), pump.advance(10.0)),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_every_terminal_path_returns_ring_space_and_pages(failure: str) -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    expect(pump, 1, 24)
    attach(pump, 1, 24)
    compute(pump, 1, 16)
    pump.run()
    FAILURES[failure](pump)
    pump.release_held()
    pump.advance(60.0)
    assert pump.outcome("d0", 1) not in (None, "ok")
    assert len(pump.freed_pages("d0", 1)) == 1
    assert decode(pump).ring.num_live == 0
    assert decode(pump).is_quiescent()
    assert all(ep.is_quiescent() for ep in pump.endpoints.values())


# ---- R2 register before announce -----------------------------------------------------------------------------------
def test_room_is_registered_before_its_metadata_is_sent() -> None:
    pump = make_pump()
    attach(pump, 1, 16)
    actions = pump.call(
        "d0",
        ExpectRoom(1, ("p0", "p1"), 16, 0, (1, 2, 3, 4), 30.0),
    )
    assert len(sent(actions, Metadata)) == 2
    assert 1 in decode(pump).open_rooms()
    # the metadata's answer can be handled at once: a request right behind it is granted, not refused
    grant = sent(inject(pump, "d0", "p0", StagingRequest(room=1, chunk=0)), Grant)
    assert len(grant) == 1


def test_staging_request_for_unknown_room_gets_an_explicit_refusal() -> None:
    pump = make_pump()
    actions = inject(pump, "d0", "p0", StagingRequest(room=77, chunk=0))
    refusals = sent(actions, GrantRefused, "p0")
    assert refusals == [GrantRefused(room=77, chunk=0, reason=reasons.UNKNOWN_ROOM)]
    assert decode(pump).ring.num_live == 0 and not decode(pump).open_rooms()


def test_writer_retries_a_refused_unknown_room_until_its_deadline() -> None:
    pump = make_pump()
    attach(pump, 5, 16, deadline=2.0)
    inject(pump, "p0", "d0", metadata(5))  # d0 never registered room 5
    compute(pump, 5, 16)
    pump.advance(5.0)
    assert decode(pump).stats.refusals_sent >= 4
    assert pump.outcome("p0", 5) == reasons.TIMEOUT
    assert decode(pump).ring.num_live == 0


# ---- R3 explicit, scoped failure -----------------------------------------------------------------------------------
def test_failed_bulk_write_fails_only_its_room() -> None:
    pump = make_pump()
    pump.hold = lambda src, a: isinstance(a, WriteRegion) and a.room == 1
    full_room(pump, 1, 16)
    full_room(pump, 2, 16)
    pump.release_held(ok=False)
    pump.run()
    assert pump.outcome("p0", 1) == reasons.TRANSFER_FAILED
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_PREFILL
    assert pump.outcome("d0", 2) == "ok" and pump.outcome("p0", 2) == "ok"
    assert all_quiescent(pump)


def test_failed_chunk_ready_send_fails_that_room_instead_of_being_swallowed() -> None:
    pump = make_pump()
    pump.drop = lambda src, dst, env: isinstance(env.body, ChunkReady) and env.body.room == 1 and src == "p0"
    full_room(pump, 1, 8)
    notice = next(
        a for src, a in pump.log if src == "p0" and isinstance(a, Send) and isinstance(a.envelope.body, ChunkReady)
    )
    pump.call("p0", SendFailed("d0", notice.envelope, "outbox full"))
    pump.drop = None
    full_room(pump, 2, 8)
    pump.advance(5.0)
    assert pump.outcome("p0", 1) == reasons.SEND_FAILED
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_PREFILL
    assert pump.outcome("d0", 2) == "ok"
    assert prefill(pump).stats.sends_failed == 1
    assert all_quiescent(pump)


def test_chunk_larger_than_the_ring_fails_its_room_at_once_without_fallback() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES // 2)
    full_room(pump, 1, 16)
    pump.run()
    assert pump.outcome("d0", 1) == reasons.STAGING_OVERSIZED
    assert pump.outcome("p0", 1) == reasons.ABORTED_BY_DECODE
    assert not [a for _, a in pump.log if isinstance(a, WriteRegion | WriteDirect | Scatter)]
    assert not sends_from(pump, "d0", Metadata)
    full_room(pump, 2, 4)  # a 4-token chunk fits: the endpoint keeps serving
    assert pump.outcome("d0", 2) == "ok"
    assert all_quiescent(pump)


# ---- R4 reliable control plane -------------------------------------------------------------------------------------
def count_sends(scenario) -> int:
    pump = make_pump(heads=8, prefill_tp=4, decode_tp=2)
    scenario(pump)
    return sum(isinstance(a, Send) for _, a in pump.log)


def success_scenario(pump: Pump) -> None:
    full_room(pump, 1, 20)
    pump.advance(10.0)


def abort_scenario(pump: Pump) -> None:
    expect(pump, 1, 20)
    attach(pump, 1, 20)
    compute(pump, 1, 8)
    pump.run()
    pump.call("d0", AbortRoom(1))  # the decode engine aborts the request on every rank
    pump.call("d1", AbortRoom(1))
    pump.advance(10.0)


@pytest.mark.parametrize("scenario", [success_scenario, abort_scenario], ids=["success", "abort"])
def test_no_single_lost_message_stalls_a_room(scenario) -> None:
    total = count_sends(scenario)
    for lost in range(total):
        pump = make_pump(heads=8, prefill_tp=4, decode_tp=2)
        counter = iter(range(10**9))
        pump.drop = lambda src, dst, env, lost=lost, counter=counter: next(counter) == lost
        scenario(pump)
        outcomes = {pump.outcome(name, 1) for name in pump.endpoints}
        assert None not in outcomes, f"message {lost} of {total} lost: a room never ended"
        if scenario is success_scenario:
            assert outcomes == {"ok"}, f"message {lost} lost: {outcomes}"
        assert all(ep.is_quiescent() for ep in pump.endpoints.values()), f"message {lost} lost: not quiescent"


class ChaoticPump(Pump):
    """Delivers every message twice and in a shuffled order (seeded), but loses nothing."""

    def run(self, max_steps: int = 200_000) -> None:
        rng = random.Random(len(self.log))
        steps = 0
        while self.queue:
            steps += 1
            assert steps < max_steps
            items = list(self.queue)
            rng.shuffle(items)
            self.queue.clear()
            self.queue.extend(items)
            name, event = self.queue.popleft()
            if name in self.endpoints:
                self.call(name, event)

    def _execute(self, src, action) -> None:
        super()._execute(src, action)
        if isinstance(action, Send):
            self.log.pop()
            super()._execute(src, action)


@pytest.mark.parametrize("seed", range(12))
def test_duplicated_and_reordered_messages_are_handled_idempotently(seed: int) -> None:
    base = make_pump(heads=8, prefill_tp=4, decode_tp=2)
    pump = ChaoticPump(base.endpoints, now=float(seed) * 0.001)
    for room in range(1, 4):
        full_room(pump, room, 8 + 9 * room)
    pump.advance(10.0)
    for room in range(1, 4):
        assert {pump.outcome(name, room) for name in pump.endpoints} == {"ok"}
    assert sum(decode(pump, d).stats.duplicates for d in ("d0", "d1")) > 0
    assert all_quiescent(pump)


def test_unanswered_request_is_retried_with_doubling_backoff_up_to_the_cap() -> None:
    pump = make_pump()
    times: list[float] = []

    def lose_requests(src: str, dst: str, env: object) -> bool:
        if src == "p0" and isinstance(env.body, StagingRequest):  # type: ignore[attr-defined]
            times.append(pump.now)
            return True
        return False

    pump.drop = lose_requests
    full_room(pump, 1, 8)
    pump.advance(2.0)
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert gaps[:5] == [0.05, 0.1, 0.2, 0.4, 0.4]  # TIMING: 50 ms doubling up to 400 ms
    assert prefill(pump).stats.retries == len(times) - 1


def test_watermark_rides_on_every_decode_message_and_never_on_prefill_messages() -> None:
    pump = make_pump()
    full_room(pump, 1, 40)
    pump.advance(2.0)
    for src, action in pump.log:
        if isinstance(action, Send):
            assert (action.envelope.watermark is not None) == src.startswith("d")


def test_new_session_gets_the_current_watermark_at_once() -> None:
    pump = make_pump()
    full_room(pump, 1, 16)
    watermark = decode(pump).ring.watermark
    actions = inject(pump, "d0", "p7", Heartbeat(), session=42)
    hello = [a for a in actions if isinstance(a, Send) and a.peer == "p7"]
    assert hello and hello[0].envelope.watermark is not None
    assert (hello[0].envelope.watermark.round, hello[0].envelope.watermark.tail) == (watermark.round, watermark.tail)


def test_a_moved_watermark_costs_no_frame_while_every_granted_region_is_writable() -> None:
    pump = make_pump()  # a ring of 1 MiB: every region is writable when granted
    full_room(pump, 1, 40)
    assert pump.outcome("d0", 1) == "ok" and decode(pump).ring.watermark != Watermark(0, 0)
    hellos = sends_from(pump, "d0", Heartbeat)
    assert len(hellos) == 2, "one heartbeat per new writer session (R4), none per freed region"


def test_a_writer_with_a_parked_chunk_hears_the_moved_watermark_at_once() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES + CHUNK_BYTES // 2)
    pump.hold = lambda src, a: isinstance(a, Scatter) and a.room == 1
    full_room(pump, 1, 8)
    full_room(pump, 2, 8)  # wraps into round 1 over room 1's live region: parked on both writers
    assert prefill(pump).parked_count() == 1
    pump.release_held()
    pump.run()  # no clock advance: no periodic heartbeat, no retry
    assert pump.outcome("d0", 2) == "ok"
    assert all_quiescent(pump)


def test_lost_watermark_broadcast_is_recovered_by_the_periodic_heartbeat() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES + CHUNK_BYTES // 2)
    pump.hold = lambda src, a: isinstance(a, Scatter) and a.room == 1
    full_room(pump, 1, 8)
    full_room(pump, 2, 8)  # wraps into round 1 over room 1's live region: parked
    assert prefill(pump).parked_count() == 1
    pump.drop = lambda src, dst, env: src == "d0" and isinstance(env.body, Heartbeat)
    pump.release_held()
    pump.run()
    assert prefill(pump).parked_count() == 1, "the watermark update was lost"
    pump.drop = None
    pump.advance(1.0)
    assert pump.outcome("d0", 2) == "ok"
    assert all_quiescent(pump)


# ---- R5 arrival-driven completion -----------------------------------------------------------------------------------
def test_room_succeeds_when_chunks_arrive_in_reverse_order() -> None:
    pump = make_pump()
    pump.hold = lambda src, a: isinstance(a, WriteRegion)
    full_room(pump, 1, 32)
    assert len(pump.held) == 8
    pump.held.reverse()
    pump.release_held()
    pump.run()
    chunks = [a.chunk for a in pump.actions_of("d0", Scatter)]
    assert chunks == [3, 2, 1, 0]
    assert pump.outcome("d0", 1) == "ok"
    assert all_quiescent(pump)


def test_room_with_a_missing_chunk_fails_at_its_completion_deadline() -> None:
    pump = make_pump()
    pump.drop = lambda src, dst, env: isinstance(env.body, ChunkReady) and env.body.chunk == 1 and src == "p1"
    expect(pump, 1, 16, deadline=3.0)
    attach(pump, 1, 16, deadline=20.0)
    compute(pump, 1, 16)
    pump.advance(2.9)
    assert pump.outcome("d0", 1) is None
    pump.advance(3.0)
    assert pump.outcome("d0", 1) == reasons.TIMEOUT
    pump.drop = None
    pump.advance(10.0)
    assert pump.outcome("p1", 1) == reasons.ABORTED_BY_DECODE
    assert decode(pump).ring.num_live == 0
    assert all_quiescent(pump)


# ---- R6 aborts in both directions -----------------------------------------------------------------------------------
def test_abort_is_acknowledged_only_after_the_in_flight_write_completes() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 8)
    pump.call("d0", AbortRoom(1))
    pump.run()
    assert not sends_from(pump, "p0", AbortAck)
    assert pump.outcome("p0", 1) is None, "prefill must not release pages a write still reads"
    assert sends_from(pump, "p1", AbortAck)
    assert decode(pump).ring.num_live == 1
    pump.release_held()
    pump.run()
    assert sends_from(pump, "p0", AbortAck)
    assert decode(pump).ring.num_live == 0
    assert all_quiescent(pump)


def test_abort_from_prefill_fails_every_rank_of_the_room_and_releases() -> None:
    pump = make_pump(heads=8, prefill_tp=4, decode_tp=2)
    expect(pump, 1, 32)
    attach(pump, 1, 32)
    compute(pump, 1, 16)
    pump.run()
    pump.call("p2", AbortRoom(1))
    pump.advance(5.0)
    assert pump.outcome("p2", 1) == reasons.ABORTED_BY_PREFILL
    assert pump.outcome("d1", 1) == reasons.ABORTED_BY_PREFILL  # p2 writes to d1
    assert pump.outcome("p3", 1) == reasons.ABORTED_BY_DECODE
    assert pump.outcome("d0", 1) is None  # failure is scoped: d0's writers p0, p1 are not involved
    compute(pump, 1, 32)
    pump.advance(40.0)
    assert pump.outcome("d0", 1) == "ok"
    assert all_quiescent(pump)


# ---- R7 fencing ------------------------------------------------------------------------------------------------------
def test_chunk_ready_with_a_stale_epoch_is_dropped_and_counted() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 8)
    actions = inject(pump, "d0", "p0", ChunkReady(room=1, chunk=0, epoch=999))
    assert not actions
    assert decode(pump).stats.stale_dropped == 1
    assert not pump.actions_of("d0", Scatter)


def test_restarted_prefill_is_fenced_and_its_new_session_is_served_at_once() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 8)
    old = prefill(pump).config
    pump.endpoints["p0"] = PrefillEndpoint(PrefillConfig("p0", old.layout, 2, 0, TIMING), session=2)
    pump.hold = None
    full_room(pump, 2, 8)
    assert FencePeer("p0", 1, 0) in pump.actions_of("d0", FencePeer)
    assert pump.outcome("d0", 1) == reasons.PEER_RESTARTED
    assert pump.outcome("d0", 2) == "ok"
    pump.release_held()  # the dead session's late write is dropped by the transport fence
    pump.advance(5.0)
    assert decode(pump).ring.num_live == 0
    assert all_quiescent(pump)


def test_restarted_decode_fails_the_rooms_of_its_old_session_and_is_served_at_once() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 16)
    old = decode(pump).config
    pump.endpoints["d0"] = DecodeEndpoint(old, session=2)
    pump.hold = None
    full_room(pump, 2, 16)
    assert pump.outcome("p1", 1) == "ok"  # p1 had finished its part before the restart
    assert pump.outcome("p0", 1) is None, "p0 still has a write in flight: it reports only once drained"
    pump.release_held()
    pump.advance(3.0)
    assert pump.outcome("p0", 1) == reasons.PEER_RESTARTED
    assert {pump.outcome(name, 2) for name in pump.endpoints} == {"ok"}
    assert all_quiescent(pump)


def test_fenced_writer_is_told_and_comes_back_with_a_new_epoch() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    pump.drop = lambda src, dst, env: src == "p0" and pump.now < 4.0  # p0 -> d0 partitioned until t=4
    pump.advance(3.9)
    assert pump.outcome("d0", 1) == reasons.PEER_DEAD
    pump.advance(5.0)
    assert sends_from(pump, "d0", Fenced)
    assert prefill(pump).epoch_towards("d0") == 1
    compute(pump, 1, 16)  # nothing was granted under the old epoch: p0 asks again and learns the room is closed
    pump.advance(5.5)
    assert pump.outcome("p0", 1) == reasons.ROOM_CLOSED
    full_room(pump, 2, 16)
    pump.advance(6.0)
    assert pump.outcome("d0", 2) == "ok" and pump.outcome("p0", 2) == "ok"
    assert all_quiescent(pump)


def test_peers_that_fenced_each_other_reconnect_once_the_partition_heals() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    pump.drop = lambda src, dst, env: {src, dst} == {"p0", "d0"} and pump.now < 8.0
    pump.advance(7.9)
    assert pump.outcome("d0", 1) == reasons.PEER_DEAD and pump.outcome("p0", 1) == reasons.PEER_DEAD
    pump.advance(9.0)
    full_room(pump, 2, 16)
    pump.advance(12.0)
    assert pump.outcome("d0", 2) == "ok" and pump.outcome("p0", 2) == "ok"
    assert decode(pump).epoch_towards("p0") == 1 and prefill(pump).epoch_towards("d0") == 1
    assert all_quiescent(pump)


# ---- R8 peer liveness ------------------------------------------------------------------------------------------------
def test_crashed_writer_is_declared_dead_and_its_quarantined_space_freed() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 16)
    pump.endpoints.pop("p0")  # crash: its write never completes, it never answers
    pump.call("d0", AbortRoom(1))
    pump.advance(2.0)
    assert decode(pump).ring.num_live == 2
    pump.advance(5.0)
    assert decode(pump).ring.num_live == 0
    assert "p0" not in decode(pump).peers()
    assert decode(pump).stats.peers_dead == 1
    assert decode(pump).is_quiescent()


def test_dead_peer_is_pruned_and_gets_no_more_broadcasts() -> None:
    pump = make_pump(prefill_instances=2)
    expect(pump, 1, 16, instance=1)
    pump.endpoints.pop("p1.0")
    pump.endpoints.pop("p1.1")
    pump.advance(5.0)
    assert pump.outcome("d0", 1) == reasons.PEER_DEAD
    cutoff = len(pump.log)
    for room in range(2, 6):
        full_room(pump, room, 24)
    pump.advance(10.0)
    late = [a for _, a in pump.log[cutoff:] if isinstance(a, Send) and a.peer.startswith("p1.")]
    assert late == []
    assert decode(pump).peers() == {"p0", "p1"}


def test_silent_decode_fails_the_prefill_rooms_with_peer_dead() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    pump.endpoints.pop("d0")
    compute(pump, 1, 16)
    pump.advance(10.0)
    assert pump.outcome("p0", 1) == reasons.PEER_DEAD and pump.outcome("p1", 1) == reasons.PEER_DEAD
    assert prefill(pump).is_quiescent()


# ---- R9 no head-of-line blocking -----------------------------------------------------------------------------------
def test_chunk_waiting_for_ring_space_is_parked_while_other_rooms_proceed() -> None:
    pump = make_pump(ring_bytes=2 * CHUNK_BYTES + 100)
    pump.hold = lambda src, a: isinstance(a, Scatter) and a.room == 1
    for room in (1, 3, 2):  # grants in this order: 1 -> [0, 4096), 3 -> [4096, 8192), 2 wraps over room 1
        expect(pump, room, 8)
        attach(pump, room, 8)
        for name in ("p0", "p1"):
            pump.call(name, ComputeScheduled(room, 8))
        pump.run()
    compute(pump, 1, 8)
    compute(pump, 2, 8)
    pump.run()
    assert prefill(pump, "p0").parked_count() == 1 and prefill(pump, "p1").parked_count() == 1
    compute(pump, 3, 8)
    pump.run()
    assert pump.outcome("d0", 3) == "ok", "room 3 must not wait behind parked room 2"
    assert pump.outcome("d0", 2) is None
    pump.release_held()
    pump.run()
    assert pump.outcome("d0", 2) == "ok" and pump.outcome("d0", 1) == "ok"
    assert all_quiescent(pump)


# ---- R10 bounded state ---------------------------------------------------------------------------------------------
def test_out_of_range_chunk_index_is_refused_and_allocates_nothing() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    actions = inject(pump, "d0", "p0", StagingRequest(room=1, chunk=60_000))
    assert sent(actions, GrantRefused) == [GrantRefused(room=1, chunk=60_000, reason=reasons.PROTOCOL_VIOLATION)]
    inject(pump, "d0", "p0", ChunkReady(room=1, chunk=60_000, epoch=0))
    assert decode(pump).ring.num_live == 0
    assert decode(pump).stats.messages_rejected["chunk index out of range"] == 2


def test_flood_of_messages_for_unknown_rooms_allocates_nothing() -> None:
    pump = make_pump(limits=Limits(max_rooms_per_peer=8))
    for room in range(1000, 3000):
        for body in (
            StagingRequest(room=room, chunk=0),
            ChunkReady(room=room, chunk=0, epoch=0),
            Abort(room=room, reason="x"),
            AbortAck(room=room),
            MetadataAck(room=room),
        ):
            inject(pump, "d0", "p0", body)
        inject(pump, "p0", "d0", Grant(room=room, chunk=0, round=0, offset=0, end=10, epoch=0))
    d0, p0 = decode(pump), prefill(pump)
    assert d0.ring.num_live == 0 and not d0.open_rooms() and d0.pending_retries() == 0
    assert not p0.open_rooms() and p0.pending_retries() == 0


def test_metadata_for_unattached_rooms_is_capped_per_peer() -> None:
    pump = make_pump(limits=Limits(max_rooms_per_peer=8))
    answers = []
    for room in range(20):
        answers += inject(pump, "p0", "d0", metadata(room))
    assert prefill(pump).pending_metadata() == 8
    assert len(sent(answers, MetadataAck)) == 8
    assert {a.reason for a in sent(answers, Abort)} == {reasons.OVERLOADED}
    pump.advance(11.0)  # unattached metadata expires with its ttl
    assert prefill(pump).pending_metadata() == 0


def test_closed_room_record_forgets_its_oldest_rooms_beyond_its_cap() -> None:
    pump = make_pump(limits=Limits(max_closed_rooms=2))
    for room in (1, 2, 3):
        full_room(pump, room, 8)
    answers = inject(pump, "d0", "p0", StagingRequest(room=1, chunk=0))
    answers += inject(pump, "d0", "p0", StagingRequest(room=3, chunk=0))
    assert [refusal.reason for refusal in sent(answers, GrantRefused)] == [reasons.UNKNOWN_ROOM, reasons.ROOM_CLOSED]


def test_peer_table_is_capped() -> None:
    pump = make_pump(limits=Limits(max_peers=4))
    for i in range(10):
        inject(pump, "d0", f"stranger{i}", Heartbeat())
    assert len(decode(pump).peers()) == 4
    assert decode(pump).stats.messages_rejected["too many peers"] == 6


def test_request_from_a_prefill_rank_that_writes_nothing_here_is_refused() -> None:
    pump = make_pump(heads=2, prefill_tp=4, decode_tp=1)  # room 4 (turn 0): d0's writers are p0 and p2
    expect(pump, 4, 16)
    actions = inject(pump, "d0", "p1", StagingRequest(room=4, chunk=0))
    assert sent(actions, GrantRefused)[0].reason == reasons.PROTOCOL_VIOLATION
    assert decode(pump).ring.num_live == 0


def test_grant_outside_the_ring_fails_the_room_instead_of_writing_there() -> None:
    pump = make_pump(ring_bytes=4 * CHUNK_BYTES)
    pump.drop = lambda src, dst, env: isinstance(env.body, Grant)
    full_room(pump, 1, 8)
    forged = Grant(room=1, chunk=0, round=0, offset=4 * CHUNK_BYTES, end=5 * CHUNK_BYTES, epoch=0)
    inject(pump, "p0", "d0", forged)
    pump.run()
    assert pump.outcome("p0", 1) == reasons.PROTOCOL_VIOLATION
    assert not pump.actions_of("p0", WriteRegion)


def test_abort_from_a_peer_never_heard_before_cannot_doom_a_future_room() -> None:
    pump = make_pump()
    assert sent(inject(pump, "p0", "forger", Abort(room=1, reason="x")), AbortAck)
    full_room(pump, 1, 16)
    assert {pump.outcome(name, 1) for name in pump.endpoints} == {"ok"}


def test_abort_from_a_known_decode_peer_before_attach_fails_the_room_at_attach() -> None:
    pump = make_pump(ring_bytes=CHUNK_BYTES // 2)  # the room is oversized: d0 aborts before any metadata
    full_room(pump, 1, 4)  # small enough: d0 and p0 know each other now
    expect(pump, 2, 16)
    pump.run()
    attach(pump, 2, 16)
    assert pump.outcome("p0", 2) == reasons.ABORTED_BY_DECODE


def test_metadata_that_disagrees_with_the_layout_is_rejected_with_an_abort() -> None:
    pump = make_pump()
    attach(pump, 1, 16)
    bad = metadata(1, path="direct", pages=(1, 2))  # 2 pages for 16 tokens of page size 4
    actions = inject(pump, "p0", "d0", bad)
    assert sent(actions, Abort)[0].reason == reasons.BAD_METADATA
    assert not sent(actions, StagingRequest)


def test_a_room_whose_prefill_engine_computes_another_prompt_fails_instead_of_landing() -> None:
    pump = make_pump()
    expect(pump, 1, 16, prompt=b"prompt decode holds")
    attach(pump, 1, 16, prompt=b"another prompt")
    compute(pump, 1, 16)
    pump.advance(5.0)
    assert pump.outcome("p0", 1) == reasons.BAD_METADATA
    assert pump.outcome("d0", 1) == reasons.ABORTED_BY_PREFILL
    assert not pump.actions_of("p0", WriteRegion) and not pump.actions_of("p0", WriteDirect)
    assert all_quiescent(pump)


def test_a_room_with_the_same_prompt_digest_on_both_sides_succeeds() -> None:
    pump = make_pump()
    expect(pump, 1, 16, prompt=b"same")
    attach(pump, 1, 16, prompt=b"same")
    compute(pump, 1, 16)
    pump.run()
    assert {pump.outcome(name, 1) for name in pump.endpoints} == {"ok"}


def test_a_request_the_prefill_engine_gives_up_before_attaching_fails_decodes_room_at_once() -> None:
    pump = make_pump(heads=8, prefill_tp=2, decode_tp=2)
    expect(pump, 1, 32)
    pump.run()  # every prefill rank holds decode's Metadata, waiting for its engine to attach the room
    for name in prefill_names(pump):
        pump.call(name, AbortRoom(1))
    pump.advance(1.0)  # far below the room's 30 s deadline
    assert {pump.outcome(name, 1) for name in decode_names(pump)} == {reasons.ABORTED_BY_PREFILL}
    attach(pump, 1, 32)  # the engine's attach, should it still come, finds the room closed
    assert pump.outcome("p0", 1) == reasons.ABORTED_BY_PREFILL
    pump.advance(5.0)
    assert all_quiescent(pump)


# ---- R11 no over-commit -------------------------------------------------------------------------------------------
def test_staging_is_requested_in_chunk_order_only_for_chunks_about_to_be_computed() -> None:
    pump = make_pump()
    expect(pump, 1, 64)
    attach(pump, 1, 64)
    pump.run()
    requested = lambda: [b.chunk for b in sends_from(pump, "p0", StagingRequest)]  # noqa: E731
    assert requested() == []
    pump.call("p0", ComputeScheduled(1, 16))
    assert requested() == [0, 1]
    pump.call("p0", ComputeScheduled(1, 64))
    assert requested() == [0, 1, 2, 3], "at most max_chunks_ahead unwritten chunks"
    pages = tuple(range(16))
    pump.call("p0", KVReady(1, 16, pages[:4]))
    pump.run()
    assert requested()[:6] == [0, 1, 2, 3, 4, 5]
    assert requested() == sorted(requested())


# ---- R12 path choice -------------------------------------------------------------------------------------------------
def test_staging_configuration_is_validated_at_endpoint_construction() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        DecodeConfig("d0", layout(8, 16), 1, 0, chunk_tokens=24, ring_bytes=1 << 20)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        DecodeConfig("d0", layout(8, 16), 1, 0, chunk_tokens=0, ring_bytes=1 << 20)
    DecodeConfig("d0", layout(1, 16), 1, 0, chunk_tokens=16, ring_bytes=1 << 20, attention="mla")


def test_matched_tp_room_never_touches_the_ring() -> None:
    pump = make_pump(heads=8, prefill_tp=2, decode_tp=2)
    full_room(pump, 1, 50)
    assert decode(pump, "d0").ring.high_water == 0 and decode(pump, "d1").ring.high_water == 0
    assert {pump.outcome(name, 1) for name in pump.endpoints} == {"ok"}


def test_counters_are_exported_as_a_flat_dict() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 8)
    pump.call("d0", AbortRoom(1))
    pump.release_held()
    pump.run()
    snapshot = decode(pump).stats.snapshot()
    assert snapshot["failures.aborted by decode"] == 1 and snapshot["rooms_failed"] == 1
    assert all(isinstance(v, int) for v in snapshot.values())
    assert any(isinstance(a, RoomFailed) for a in pump.actions_of("p0", RoomFailed))


def test_metadata_waiting_for_attach_is_capped_in_page_ids_not_only_rooms() -> None:
    pump = make_pump(limits=Limits(max_pending_pages=10), prefill_tp=1)  # matched TP, direct: Metadata carries pages
    answers = []
    for room in range(4):
        answers += inject(pump, "p0", "d0", metadata(room, path="direct", prefill_tp=1, pages=tuple(range(4))))
    answers += inject(
        pump, "p0", "d0", metadata(1, path="direct", prefill_tp=1, pages=tuple(range(4)))
    )  # a retry still waits
    assert prefill(pump).pending_metadata() == 2
    assert len(sent(answers, MetadataAck)) == 3
    assert {a.reason for a in sent(answers, Abort)} == {reasons.OVERLOADED}
    assert prefill(pump).stats.messages_rejected["pending metadata pages cap reached"] == 2
    pump.advance(11.0)  # the waiting ones expire with their ttl, and their page ids with them
    answers = inject(pump, "p0", "d0", metadata(9, path="direct", prefill_tp=1, num_tokens=32, pages=tuple(range(8))))
    assert sent(answers, MetadataAck) and prefill(pump).pending_metadata() == 1
