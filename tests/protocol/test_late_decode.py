"""A room attached before its decode instance is known (vLLM's sequential flow): prefill computes the prompt, then
holds its pages until decode's ranks send their Metadata, which also say decode's TP size, or its deadline; and, once
a decode rank has taken the room, only as long as that rank is heard from (`Timing.decode_dead_after_s`); with a claim
time (`AttachRoom.claim_s`), a computed room no decode rank takes fails "unclaimed" that long after it was computed."""

from __future__ import annotations

import pytest
from protocol_harness import (
    TIMING,
    all_quiescent,
    attach,
    compute,
    decode_names,
    expect,
    inject,
    make_pump,
    metadata,
    prefill,
    prefill_names,
    sent,
)

from kvstage.protocol import Timing, WriteRegion, reasons
from kvstage.protocol.messages import Abort, Grant


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), [(8, 2, 1), (8, 1, 2), (8, 4, 2), (2, 2, 4)])
def test_a_room_computed_before_decode_is_known_lands_once_decode_registers_it(
    heads: int, prefill_tp: int, decode_tp: int
) -> None:
    pump = make_pump(heads=heads, prefill_tp=prefill_tp, decode_tp=decode_tp)
    attach(pump, 1, 45, decode_tp=0)
    compute(pump, 1, 45)
    pump.advance(5.0)  # prefill has computed everything and waits: no decode rank has asked for the room yet
    assert all(pump.outcome(name, 1) is None for name in pump.endpoints)
    assert not pump.actions_of("p0", WriteRegion)
    expect(pump, 1, 45, prefix=4)
    pump.advance(10.0)
    assert all(pump.outcome(name, 1) == "ok" for name in pump.endpoints)
    assert {a.peer for name in prefill_names(pump) for a in pump.actions_of(name, WriteRegion)} == set(
        decode_names(pump)
    )
    assert all_quiescent(pump)


def test_a_room_whose_decode_never_comes_fails_at_its_deadline_and_leaves_nothing_behind() -> None:
    pump = make_pump()
    attach(pump, 2, 16, decode_tp=0, deadline=8.0)
    compute(pump, 2, 16)
    pump.advance(7.9)
    assert pump.outcome("p0", 2) is None
    pump.advance(9.0)
    assert all(pump.outcome(name, 2) == reasons.TIMEOUT for name in prefill_names(pump))
    assert all_quiescent(pump)


def test_decode_ranks_that_disagree_on_their_tp_size_fail_the_room() -> None:
    pump = make_pump(heads=8, prefill_tp=1, decode_tp=2)
    attach(pump, 3, 16, decode_tp=0)
    compute(pump, 3, 16)
    first = inject(pump, "p0", "d0", metadata(3, decode_tp=2, prefill_tp=1))
    assert not sent(first, Abort)
    second = inject(pump, "p0", "d1", metadata(3, decode_rank=0, decode_tp=1, prefill_tp=1))
    for peer in ("d0", "d1"):  # the rank that disagrees, and the rank already linked to the failed room
        assert [a.reason for a in sent(second, Abort, peer)] == [reasons.BAD_METADATA]
    pump.advance(5.0)
    assert pump.outcome("p0", 3) == reasons.BAD_METADATA
    assert prefill(pump).open_rooms() == frozenset()


#: A prefill rank that waits 20 s for a silent writer's peer but only 2 s for a silent decode rank.
SHORT_DECODE_SILENCE = Timing(heartbeat_s=0.5, dead_after_s=20.0, decode_dead_after_s=2.0, retry_initial_s=0.05,
                              retry_max_s=0.4)  # fmt: skip


def _room_taken_then_decode_gone(prefill_timing: Timing, decode_dies: bool) -> tuple:
    """Room 4 (45 tokens) attached on p0 and p1 for a decode not known yet, its first chunk computed, taken by d0;
    then at t=3 d0
    dies (every frame from it is lost from then on) or stays, and prefill computes nothing more."""
    pump = make_pump(heads=8, prefill_tp=2, decode_tp=1, prefill_timing=prefill_timing)
    attach(pump, 4, 45, decode_tp=0, deadline=60.0)
    compute(pump, 4, 8)
    expect(pump, 4, 45, deadline=60.0)
    pump.advance(3.0)
    assert pump.outcome("p0", 4) is None and pump.actions_of("p0", WriteRegion), "mid-transfer: the first chunk went"
    if decode_dies:
        pump.drop = lambda src, dst, envelope: src == "d0"
    return pump


def test_a_prefill_rank_frees_a_room_within_seconds_of_its_decode_ranks_death_not_at_the_rooms_deadline() -> None:
    pump = _room_taken_then_decode_gone(SHORT_DECODE_SILENCE, decode_dies=True)
    pump.advance(3.0 + SHORT_DECODE_SILENCE.decode_dead_after_s + SHORT_DECODE_SILENCE.heartbeat_s)
    for name in prefill_names(pump):
        assert pump.outcome(name, 4) == reasons.PEER_DEAD
        assert prefill(pump, name).open_rooms() == frozenset() and prefill(pump, name).is_quiescent()


def test_a_decode_rank_that_keeps_heartbeating_holds_its_room_however_long_prefill_takes() -> None:
    pump = _room_taken_then_decode_gone(SHORT_DECODE_SILENCE, decode_dies=False)
    pump.advance(30.0)
    assert all(pump.outcome(name, 4) is None for name in ("p0", "p1", "d0"))


def test_decode_dead_after_defaults_to_dead_after_so_a_dead_decode_rank_is_waited_for_that_long() -> None:
    pump = _room_taken_then_decode_gone(TIMING, decode_dies=True)
    assert TIMING.decode_dead_after_s == TIMING.dead_after_s
    pump.advance(3.0 + TIMING.dead_after_s - TIMING.heartbeat_s)
    assert pump.outcome("p0", 4) is None
    pump.advance(3.0 + TIMING.dead_after_s + TIMING.heartbeat_s)
    assert pump.outcome("p0", 4) == reasons.PEER_DEAD


def test_a_computed_room_no_decode_rank_takes_fails_unclaimed_after_its_claim_time_not_at_its_deadline() -> None:
    pump = make_pump()
    attach(pump, 5, 16, decode_tp=0, deadline=60.0, claim_s=4.0)
    pump.advance(10.0)  # a long prompt: the claim time counts from the moment it is computed, not from the attach
    compute(pump, 5, 16)
    pump.advance(13.9)
    assert pump.outcome("p0", 5) is None
    pump.advance(14.1)
    assert all(pump.outcome(name, 5) == reasons.UNCLAIMED for name in prefill_names(pump))
    assert all(prefill(pump, name).open_rooms() == frozenset() for name in prefill_names(pump))
    expect(pump, 5, 16, deadline=60.0)  # decode's request comes after all: its room fails at once, decode recomputes
    pump.advance(15.0)
    assert pump.outcome("d0", 5) is not None and pump.outcome("d0", 5) != "ok"
    assert all_quiescent(pump)


def test_a_room_decode_takes_within_its_claim_time_lands_however_long_its_transfer_then_takes() -> None:
    pump = make_pump()
    attach(pump, 6, 45, decode_tp=0, deadline=60.0, claim_s=2.0)
    compute(pump, 6, 45)
    pump.advance(1.5)
    pump.drop = lambda src, dst, envelope: isinstance(envelope.body, Grant) and pump.now < 8.0
    expect(pump, 6, 45, deadline=60.0)  # taken at 1.5 s; its grants are lost until 8 s (retried): no unclaimed
    pump.advance(20.0)
    assert all(pump.outcome(name, 6) == "ok" for name in pump.endpoints)


def test_prefill_ranks_that_write_nothing_hear_decode_tp_from_decode_rank_0_and_end_at_once() -> None:
    """Replicated heads (2 KV heads over 4 prefill ranks, one decode rank taking each head from one replica): two
    prefill ranks write nothing. Attached without decode's TP, they used to wait for Metadata that never comes, to
    the room's deadline; decode rank 0's writes-nothing notice now ends them as soon as decode registers."""
    pump = make_pump(heads=2, prefill_tp=4, decode_tp=1)
    attach(pump, 7, 24, decode_tp=0, deadline=60.0)
    compute(pump, 7, 24)
    expect(pump, 7, 24, deadline=60.0)
    pump.advance(2.0)
    writers = {a.peer for name in prefill_names(pump) for a in pump.actions_of(name, WriteRegion)}
    assert writers == {"d0"}
    assert all(pump.outcome(name, 7) == "ok" for name in pump.endpoints)
    idle = [name for name in prefill_names(pump) if not pump.actions_of(name, WriteRegion)]
    assert len(idle) == 2 and all(prefill(pump, name).open_rooms() == frozenset() for name in idle)
    assert all_quiescent(pump)


def test_a_writes_nothing_notice_to_a_rank_that_writes_is_refused_and_changes_nothing() -> None:
    pump = make_pump()  # 8 heads over 2 prefill ranks: both write to d0
    attach(pump, 8, 16, decode_tp=0)
    compute(pump, 8, 16)
    answer = inject(pump, "p0", "stranger", metadata(8, bystander=True))  # p0 writes to d0: the notice does not fit
    assert [a.reason for a in sent(answer, Abort, "stranger")] == [reasons.BAD_METADATA]
    assert pump.outcome("p0", 8) is None and prefill(pump).open_rooms() == frozenset({8})
    expect(pump, 8, 16)
    pump.advance(5.0)
    assert all(pump.outcome(name, 8) == "ok" for name in pump.endpoints)
