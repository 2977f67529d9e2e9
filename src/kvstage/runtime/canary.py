"""A staging ring that proves no write lands in space it has released: `CanaryRing`, the decode agent's ring when
`AgentConfig.ring_canary` is set (a diagnostic for tests and deployments under suspicion; off by default).

Owns the canary: every byte of the ring's memory outside its live allocations holds `CANARY`. The memory starts
filled; a freed allocation's bytes are filled again at once (its scatter has finished: decode frees a region only
after that); and before the ring hands out an allocation (every chunk of every room takes one), the bytes no
live allocation covers are compared with the canary. A byte that differs was written while no room held it, that
is after its room released the space (a late write) or before it was granted: it is logged with its range, counted
through `on_violation`, and the canary is restored there so that one late write is counted once. The report names
the dirty bytes and, from the last `FREED_KEPT` frees, the allocations (ring epoch) that held them and how long
before the check each was freed: a late write's room and writer follow from its chunk's grant (its region's epoch).

Invariants: a legitimate write only ever targets a live allocation, so the check has no false alarm. It compares
the free bytes at every allocation on the reactor: host memory eight bytes at a time through numpy (about
1 ms per 8 MiB on a loaded 2-core host; torch's elementwise compare and sum took 150-280 ms there, long enough to
silence the agent past a short `dead_after_s`), device memory on its GPU. Keep the ring small where it is on. Called by
`DecodeAgent._make_endpoint`; the bookkeeping stays `StagingRing`'s (kvstage.ring), the bytes are the agent's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvstage.ring import Allocation, StagingRing

log = logging.getLogger(__name__)

#: The byte that fills released ring space.
CANARY = 0xA5
#: How many of the latest frees the ring remembers, to name what held the bytes a late write hit.
FREED_KEPT = 256
#: Eight of them, to compare host memory eight bytes at a time.
_CANARY_WORD = np.uint64(int.from_bytes(bytes([CANARY]) * 8, "little"))


class CanaryRing(StagingRing):
    """A `StagingRing` over `memory` (a flat uint8 tensor of `capacity_bytes`) whose free bytes hold `CANARY`;
    `on_violation(nbytes)` is called for each run of free bytes found overwritten."""

    def __init__(
        self, capacity_bytes: int, alignment: int, memory: torch.Tensor, on_violation: Callable[[int], None]
    ) -> None:
        super().__init__(capacity_bytes, alignment)
        if memory.dtype != torch.uint8 or memory.numel() != capacity_bytes:
            raise ValueError(f"the canary ring needs {capacity_bytes} bytes of uint8 memory, got {memory.numel()}")
        self._memory = memory
        self._on_violation = on_violation
        self._freed: deque[tuple[Allocation, float]] = deque(maxlen=FREED_KEPT)  # with `time.monotonic()`
        _fill(self._memory)

    def allocate(self, nbytes: int) -> Allocation:
        self.check()
        return super().allocate(nbytes)

    def free(self, allocation: Allocation) -> bool:
        freed = super().free(allocation)
        if freed:
            _fill(self._memory[allocation.offset : allocation.end])
            self._freed.append((allocation, time.monotonic()))
        return freed

    def check(self) -> int:
        """Compare every free byte with the canary; the number of bytes found overwritten (each run reported)."""
        dirty = 0
        for start, end in self._free_runs():
            run = self._memory[start:end]
            if _intact(run):
                continue
            dirty_at = (run != CANARY).nonzero()
            wrong = len(dirty_at)
            if wrong:
                first, last = start + int(dirty_at[0]), start + int(dirty_at[-1]) + 1
                log.error(
                    "ring canary: %d of the free bytes [%d, %d) were written while no room held them (a write "
                    "landed after its room released the space), within [%d, %d); %s",
                    wrong,
                    start,
                    end,
                    first,
                    last,
                    self._held(first, last),
                )
                self._on_violation(wrong)
                _fill(run)
                dirty += wrong
        return dirty

    def _held(self, start: int, end: int) -> str:
        """Which of the latest freed allocations covered bytes of `[start, end)`, newest first."""
        now = time.monotonic()
        held = [
            f"epoch {a.epoch} [{a.offset}, {a.end}) freed {now - at:.1f} s ago"
            for a, at in reversed(self._freed)
            if a.offset < end and start < a.end
        ]
        return "held last by " + ", ".join(held) if held else f"none of the last {FREED_KEPT} frees held them"

    def _free_runs(self) -> Iterator[tuple[int, int]]:
        """The byte ranges no live allocation covers, in order."""
        at = 0
        for live in sorted(self.live(), key=lambda a: a.offset):
            if live.offset > at:
                yield at, live.offset
            at = max(at, live.end)
        if at < self.capacity_bytes:
            yield at, self.capacity_bytes


def _intact(run: torch.Tensor) -> bool:
    """Whether every byte of `run` is the canary (the fast path: no per-byte count)."""
    if run.is_cuda:
        return not bool((run != CANARY).any())
    host = run.numpy()
    words = len(host) // 8 * 8
    return bool((host[:words].view(np.uint64) == _CANARY_WORD).all()) and bool((host[words:] == CANARY).all())


def _fill(run: torch.Tensor) -> None:
    if run.is_cuda:
        run.fill_(CANARY)
    else:
        run.numpy().fill(CANARY)
