"""The canary ring (kvstage.runtime.canary): free ring bytes hold a canary, so a write that lands after its room
released the space is found, counted once and reported; writes into live allocations never are."""

from __future__ import annotations

import torch

from kvstage.runtime.canary import CANARY, CanaryRing

CAPACITY = 4096


def ring() -> tuple[CanaryRing, torch.Tensor, list[int]]:
    memory = torch.zeros(CAPACITY, dtype=torch.uint8)
    found: list[int] = []
    return CanaryRing(CAPACITY, 64, memory, found.append), memory, found


def test_writes_into_live_allocations_over_many_rounds_raise_no_alarm() -> None:
    canary, memory, found = ring()
    live = []
    for i in range(200):
        allocation = canary.allocate(1000)
        memory[allocation.offset : allocation.end] = i % 251  # what a writer and the scatter do with a live region
        live.append(allocation)
        if len(live) > 2:
            canary.free(live.pop(0))
    for allocation in live:
        canary.free(allocation)
    assert found == []
    assert bool((memory == CANARY).all())


def test_a_write_after_its_region_was_freed_is_found_at_the_next_allocation_and_counted_once() -> None:
    canary, memory, found = ring()
    first = canary.allocate(1024)
    canary.free(first)
    memory[first.offset + 10 : first.offset + 20] = 7  # a late write into released space
    canary.allocate(512)
    assert found == [10]
    canary.allocate(512)
    assert found == [10]  # the canary was restored: one late write, one report


def test_a_late_write_anywhere_in_free_space_is_found_by_an_allocation_elsewhere() -> None:
    canary, memory, found = ring()
    first, second = canary.allocate(1024), canary.allocate(1024)
    canary.free(first)
    memory[first.offset] = 0  # released space the next allocation does not reuse
    canary.free(second)
    canary.allocate(64)
    assert found == [1]
    assert canary.check() == 0


def test_a_late_write_is_reported_with_its_bytes_and_the_freed_allocation_that_held_them(caplog) -> None:
    canary, memory, found = ring()
    first, second = canary.allocate(1024), canary.allocate(1024)
    canary.free(first)
    canary.free(second)
    memory[second.offset + 100 : second.offset + 164] = 1  # a late write of `second`'s room
    canary.check()
    assert found == [64]
    (report,) = [r.getMessage() for r in caplog.records if r.name == "kvstage.runtime.canary"]
    assert f"within [{second.offset + 100}, {second.offset + 164})" in report
    assert f"held last by epoch {second.epoch} [{second.offset}, {second.end}) freed" in report
    assert f"epoch {first.epoch} " not in report
