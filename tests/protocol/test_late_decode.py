"""A room attached before its decode instance is known (vLLM's sequential flow): prefill computes the prompt, then
holds its pages until decode's ranks send their Metadata, which also say decode's TP size, or its deadline."""

from __future__ import annotations

import pytest
from protocol_harness import (
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

from kvstage.protocol import WriteRegion, reasons
from kvstage.protocol.messages import Abort


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
