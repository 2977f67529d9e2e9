"""The decode-side staging ring: contiguous over-committing allocation, rounds, and a monotonic watermark.

Owns: `StagingRing`, its `Allocation`s and `Watermark`, and the writer's safety check `region_ready`.

How it works. Allocation is contiguous; a request that does not fit in the tail wraps whole to offset 0 and
the round goes up by one. `allocate` never blocks and never refuses (except a request larger than the ring): it
over-commits, and a writer may only write a region once `region_ready(allocation, watermark)` holds. The
watermark is the (round, offset) of the oldest live allocation.

Invariants:
- the watermark never decreases;
- two live allocations that are both `region_ready` under the current watermark never overlap;
- when the last live allocation is freed the ring restarts at offset 0 in a new round, so the next allocation
  of any size up to the capacity is ready at once (upstream #37166);
- `free` is idempotent.

Pure: no I/O, no clock, no randomness. Called by protocol/'s DecodeEndpoint (allocate, free, watermark) and
PrefillEndpoint (region_ready).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvstage.errors import StagingOversized


@dataclass(frozen=True, slots=True, order=True)
class Watermark:
    """Position (round, tail) of the oldest live allocation; compares as a tuple."""

    round: int
    tail: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """A contiguous region `[offset, end)` of the ring in `round`; `epoch` is unique per ring and increasing."""

    epoch: int
    round: int
    offset: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.offset


def region_ready(allocation: Allocation, watermark: Watermark) -> bool:
    """True when writing `allocation`'s region cannot clobber bytes of an older live allocation.

    A region in round r overlaps only space used in round r-1. It is writable in round 0, once every round r-1
    allocation is freed (r-1 < watermark.round), or once the oldest live round r-1 allocation starts at or
    after the region's end.
    """
    previous = allocation.round - 1
    if allocation.round == 0 or previous < watermark.round:
        return True
    return previous == watermark.round and allocation.end <= watermark.tail


class StagingRing:
    """Bookkeeping of one decode rank's staging buffer; it owns offsets, not bytes."""

    def __init__(self, capacity_bytes: int, alignment: int = 1) -> None:
        if alignment <= 0:
            raise ValueError(f"alignment must be positive, got {alignment}")
        if capacity_bytes <= 0 or capacity_bytes % alignment:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be a positive multiple of alignment={alignment}")
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self._round = 0
        self._head = 0
        self._next_epoch = 0
        self._live: dict[int, Allocation] = {}
        self._order: deque[int] = deque()
        self._watermark = Watermark(0, 0)
        self._live_bytes = 0
        self._high_water = 0

    def allocate(self, nbytes: int) -> Allocation:
        """Reserve `nbytes` contiguous bytes; never blocks. Writers must check `region_ready` before writing."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        if nbytes > self.capacity_bytes:
            raise StagingOversized(nbytes, self.capacity_bytes)
        size = -(-nbytes // self.alignment) * self.alignment
        if self._head + size > self.capacity_bytes:
            self._round += 1
            self._head = 0
        allocation = Allocation(self._next_epoch, self._round, self._head, self._head + size)
        self._next_epoch += 1
        self._head = allocation.end
        self._live[allocation.epoch] = allocation
        self._order.append(allocation.epoch)
        self._live_bytes += size
        self._high_water = max(self._high_water, self._live_bytes)
        return allocation

    def free(self, allocation: Allocation) -> bool:
        """Release `allocation`; True the first time, False for an allocation that is not live."""
        held = self._live.get(allocation.epoch)
        if held is None:
            return False
        if held != allocation:
            raise ValueError(f"{allocation} does not match the live allocation {held} of this ring")
        del self._live[allocation.epoch]
        self._live_bytes -= allocation.nbytes
        while self._order and self._order[0] not in self._live:
            self._order.popleft()
        if self._order:
            oldest = self._live[self._order[0]]
            self._watermark = Watermark(oldest.round, oldest.offset)
        else:
            self._round += 1
            self._head = 0
            self._watermark = Watermark(self._round, 0)
        return True

    @property
    def watermark(self) -> Watermark:
        """Position of the oldest live allocation; never decreases."""
        return self._watermark

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def high_water(self) -> int:
        """Largest `live_bytes` ever reached."""
        return self._high_water

    def live(self) -> tuple[Allocation, ...]:
        """Live allocations, oldest first."""
        return tuple(self._live[epoch] for epoch in self._order if epoch in self._live)
