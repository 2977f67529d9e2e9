"""StagingRing: wrapping, the monotonic watermark, writer safety, and the upstream ring bugs."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvstage.errors import StagingOversized
from kvstage.ring import Allocation, StagingRing, Watermark, region_ready


def test_allocations_are_contiguous_and_wrap_whole_into_a_new_round() -> None:
    ring = StagingRing(100)
    a = ring.allocate(40)
    b = ring.allocate(40)
    c = ring.allocate(30)
    assert (a.round, a.offset, a.end) == (0, 0, 40)
    assert (b.round, b.offset, b.end) == (0, 40, 80)
    assert (c.round, c.offset, c.end) == (1, 0, 30), "a request that does not fit the tail wraps whole"
    assert region_ready(a, ring.watermark) and region_ready(b, ring.watermark)
    assert not region_ready(c, ring.watermark), "c overlaps a, which is still live"
    ring.free(a)
    assert ring.watermark == Watermark(0, 40)
    assert region_ready(c, ring.watermark)


def test_alignment_rounds_sizes_and_offsets() -> None:
    ring = StagingRing(128, alignment=16)
    a = ring.allocate(1)
    b = ring.allocate(17)
    assert (a.offset, a.end, b.offset, b.end) == (0, 16, 16, 48)
    assert ring.live_bytes == 48


def test_free_is_idempotent_and_counts_live_bytes() -> None:
    ring = StagingRing(100)
    a = ring.allocate(10)
    assert (ring.num_live, ring.live_bytes) == (1, 10)
    assert ring.free(a) is True
    assert ring.free(a) is False
    assert (ring.num_live, ring.live_bytes, ring.high_water) == (0, 0, 10)


def test_freeing_an_allocation_of_another_ring_is_refused() -> None:
    ring = StagingRing(100)
    ring.allocate(10)
    with pytest.raises(ValueError, match="does not match"):
        ring.free(Allocation(epoch=0, round=0, offset=50, end=60))


@pytest.mark.parametrize("nbytes", [0, -5])
def test_non_positive_allocation_is_a_value_error(nbytes: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        StagingRing(100).allocate(nbytes)


def test_oversized_allocation_fails_at_once() -> None:
    # Upstream #31217: an oversized chunk silently fell back to another path or killed the worker.
    ring = StagingRing(100)
    with pytest.raises(StagingOversized, match="exceeds the ring capacity") as excinfo:
        ring.allocate(101)
    assert (excinfo.value.nbytes, excinfo.value.capacity_bytes) == (101, 100)
    assert ring.num_live == 0, "a refused request allocates nothing"


def test_empty_ring_restarts_so_a_wrapping_allocation_is_ready_at_once() -> None:
    # Upstream #37166: [0,60) freed, watermark stuck at (0,60); a 70-byte allocation wrapped and waited forever.
    ring = StagingRing(100)
    first = ring.allocate(60)
    ring.free(first)
    second = ring.allocate(70)
    assert region_ready(second, ring.watermark)
    assert second.offset == 0


def test_one_unfreed_allocation_pins_every_later_wrapped_allocation_until_freed() -> None:
    # Upstream #31217: one leaked allocation pinned the watermark and wedged the decode rank.
    ring = StagingRing(100)
    leaked = ring.allocate(30)
    wrapped = []
    for _ in range(6):
        done = ring.allocate(30)
        later = ring.allocate(30)
        ring.free(done)
        wrapped.append(later)
    blocked = [a for a in wrapped if a.round >= 1]
    assert blocked, "the scenario must wrap"
    assert ring.watermark == Watermark(0, 0), "the leak pins the watermark"
    assert not any(region_ready(a, ring.watermark) for a in blocked), "every wrapped allocation waits on the leak"
    ring.free(leaked)
    while ring.num_live:
        oldest = ring.live()[0]
        assert region_ready(oldest, ring.watermark), "with the leak gone, each waiter becomes ready in turn"
        ring.free(oldest)


def test_watermark_of_a_round_zero_region_is_irrelevant() -> None:
    assert region_ready(Allocation(0, 0, 0, 100), Watermark(0, 0))


def test_region_ready_compares_against_the_previous_round_only() -> None:
    region = Allocation(epoch=9, round=3, offset=10, end=50)
    assert region_ready(region, Watermark(3, 0)), "every round-2 allocation is gone"
    assert region_ready(region, Watermark(2, 50)), "the oldest round-2 allocation starts at the region's end"
    assert not region_ready(region, Watermark(2, 49))
    assert not region_ready(region, Watermark(1, 99)), "round-1 allocations may still hold this space"


class RingMachine(RuleBasedStateMachine):
    """Random allocate/free sequences: watermark monotonic, ready live regions disjoint, empty ring restarts."""

    allocations = Bundle("allocations")

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 256
        self.ring = StagingRing(self.capacity, alignment=1)
        self.last_watermark = self.ring.watermark
        self.live: dict[int, Allocation] = {}

    @rule(target=allocations, nbytes=st.integers(min_value=1, max_value=256))
    def allocate(self, nbytes: int) -> Allocation:
        allocation = self.ring.allocate(nbytes)
        assert allocation.end - allocation.offset >= nbytes
        assert 0 <= allocation.offset < allocation.end <= self.capacity
        self.live[allocation.epoch] = allocation
        return allocation

    @rule(allocation=consumes(allocations))
    def free(self, allocation: Allocation) -> None:
        assert self.ring.free(allocation) is True
        assert self.ring.free(allocation) is False
        del self.live[allocation.epoch]

    @precondition(lambda self: not self.live)
    @rule(nbytes=st.integers(min_value=1, max_value=256))
    def empty_ring_serves_any_size_at_once(self, nbytes: int) -> None:
        allocation = self.ring.allocate(nbytes)
        assert region_ready(allocation, self.ring.watermark)
        assert self.ring.free(allocation)

    @invariant()
    def watermark_never_decreases(self) -> None:
        assert self.ring.watermark >= self.last_watermark
        self.last_watermark = self.ring.watermark

    @invariant()
    def ready_live_regions_never_overlap(self) -> None:
        ready = sorted((a.offset, a.end) for a in self.live.values() if region_ready(a, self.ring.watermark))
        for (_, end), (start, _) in itertools.pairwise(ready):
            assert end <= start

    @invariant()
    def oldest_live_region_is_always_ready(self) -> None:
        live = self.ring.live()
        if live:
            assert region_ready(live[0], self.ring.watermark), "the ring itself can never deadlock"

    @invariant()
    def accounting_matches_the_live_set(self) -> None:
        assert self.ring.num_live == len(self.live)
        assert self.ring.live_bytes == sum(a.nbytes for a in self.live.values())
        assert self.ring.high_water >= self.ring.live_bytes


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
