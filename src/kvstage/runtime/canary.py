"""A staging ring that proves no write lands in space it has released: `CanaryRing`, the decode agent's ring when
`AgentConfig.ring_canary` is set (a diagnostic for tests and deployments under suspicion; off by default).

Owns the canary: every byte of the ring's memory outside its live allocations holds `CANARY`. The memory starts
filled; a freed allocation's bytes are filled again at once (its scatter has finished: decode frees a region only
after that); and before the ring hands out an allocation, and after every free, the bytes no live allocation
covers are compared with the canary. A byte that differs was written while no room held it, that is after its room
released the space (a late write) or before it was granted: it is logged with its range, counted through
`on_violation`, and the canary is restored there so that one late write is counted once.

Invariants: a legitimate write only ever targets a live allocation, so the check has no false alarm; it costs a
comparison of the free bytes per allocation and per free (keep the ring small where it is on). Called by
`DecodeAgent._make_endpoint`; the bookkeeping stays `StagingRing`'s (kvstage.ring), the bytes are the agent's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from kvstage.ring import Allocation, StagingRing

log = logging.getLogger(__name__)

#: The byte that fills released ring space.
CANARY = 0xA5


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
        self._memory.fill_(CANARY)

    def allocate(self, nbytes: int) -> Allocation:
        self.check()
        return super().allocate(nbytes)

    def free(self, allocation: Allocation) -> bool:
        freed = super().free(allocation)
        if freed:
            self._memory[allocation.offset : allocation.end].fill_(CANARY)
            self.check()
        return freed

    def check(self) -> int:
        """Compare every free byte with the canary; the number of bytes found overwritten (each run reported)."""
        dirty = 0
        for start, end in self._free_runs():
            run = self._memory[start:end]
            wrong = int((run != CANARY).sum())
            if wrong:
                log.error(
                    "ring canary: %d of the free bytes [%d, %d) were written while no room held them (a write "
                    "landed after its room released the space)",
                    wrong,
                    start,
                    end,
                )
                self._on_violation(wrong)
                run.fill_(CANARY)
                dirty += wrong
        return dirty

    def _free_runs(self) -> Iterator[tuple[int, int]]:
        """The byte ranges no live allocation covers, in order."""
        at = 0
        for live in sorted(self.live(), key=lambda a: a.offset):
            if live.offset > at:
                yield at, live.offset
            at = max(at, live.end)
        if at < self.capacity_bytes:
            yield at, self.capacity_bytes
