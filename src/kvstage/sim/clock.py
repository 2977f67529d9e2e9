"""Virtual time and the deterministic event queue of the simulator, and each node's own (drifting) clock.

Owns: `EventKind`, the kinds of world event; `EventQueue`, a heap of pending world events keyed by
`(time, seq)` in true time; and `NodeClock`, what one node's clock reads at a true time. `seq` grows by one per
push, so two events at the same instant always pop in the order they were scheduled, and a seed replays the same
run. Cancellation is lazy (a cancelled entry is skipped when it surfaces), so cancel is O(1).

Invariants: time never goes backwards; `pop` returns events in (time, seq) order; a node's clock is monotonic
and `when(reading)` is the first true time at which it reads at least `reading`. No wall clock is read here.
Called by the world's parts (world.py, core.py, engines.py, dataplane.py: every delivery, completion, timer
and engine step) and sim/network.py.
"""

from __future__ import annotations

import enum
import heapq
import math
from dataclasses import dataclass
from typing import Any


class EventKind(enum.Enum):
    """What a scheduled world event does when it comes up; World maps each to one handler."""

    ARRIVE = "arrive"  # a room arrives at both engines
    DELIVER = "deliver"  # a frame reaches its destination
    TICK = "tick"  # an endpoint's timer
    LAND = "land"  # a bulk or direct write lands
    COMPLETE = "complete"  # a completion (or SendFailed) reaches its endpoint
    SCATTER = "scatter"  # a scatter finishes
    FORWARD = "forward"  # a prefill forward pass finishes
    ABORT = "abort"  # an engine aborts a room
    EXPIRE = "expire"  # a room waiting for decode pages reaches its deadline
    GENERATED = "generated"  # a succeeded room finished generating; its pages go back
    POST = "post"  # a write the endpoint asked for is posted to the transport (after gather and queueing)
    CRASH = "crash"  # a prefill instance crashes
    RESTART = "restart"  # and restarts
    DECODE_CRASH = "decode crash"  # a decode instance is armed to crash while a write to it is in flight
    DECODE_RESTART = "decode restart"  # and restarts with new sessions
    QUARANTINE_RESTART = "quarantine restart"  # a writer is armed to restart while decode quarantines its room
    PARTITION = "partition"  # a set of ranks is cut off for a while
    WRITER_PARTITION = "writer partition"  # one writer's control frames are dropped; its data path stays up
    EDGE_RESTART = "edge restart"  # a writer is armed to post at its lease's edge, then restart
    PAUSE = "pause"  # a writer is armed to stall (GC, swap) right after it next asks for a write
    RESUME = "resume"  # and resumes, handling what queued up meanwhile
    HOSTILE = "hostile"  # a hostile frame arrives


@dataclass(frozen=True, slots=True)
class NodeClock:
    """One node's clock: at true time t it reads `offset + rate * t` (rate within the allowed drift of 1)."""

    offset: float = 0.0
    rate: float = 1.0

    def read(self, t: float) -> float:
        return self.offset + self.rate * t

    def when(self, reading: float) -> float:
        """The first true time at which this clock reads at least `reading` (so a timer never fires early)."""
        t = (reading - self.offset) / self.rate
        while self.read(t) < reading:
            t = math.nextafter(t, math.inf)
        return t


@dataclass(slots=True, eq=False)
class Scheduled:
    """One pending world event; the heap orders entries by the tuple (time, seq, entry)."""

    time: float
    seq: int
    kind: EventKind
    payload: Any
    cancelled: bool = False


class EventQueue:
    """A virtual clock plus a priority queue of `Scheduled` events."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Scheduled]] = []
        self._seq = 0
        self.now = 0.0
        self._live = 0

    def push(self, time: float, kind: EventKind, payload: Any = None) -> Scheduled:
        """Schedule `kind` at `time` (clamped to now: nothing is scheduled in the past)."""
        at = time if time > self.now else self.now
        entry = Scheduled(at, self._seq, kind, payload)
        heapq.heappush(self._heap, (at, self._seq, entry))
        self._seq += 1
        self._live += 1
        return entry

    def cancel(self, entry: Scheduled) -> None:
        """Skip `entry` when it comes up; idempotent."""
        if not entry.cancelled:
            entry.cancelled = True
            self._live -= 1

    def pop(self) -> Scheduled | None:
        """Advance the clock to the next live event and return it; None when nothing is pending."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)[2]
            if entry.cancelled:
                continue
            entry.cancelled = True  # popped: a later cancel() is a no-op
            self._live -= 1
            self.now = entry.time
            return entry
        return None

    def __len__(self) -> int:
        return self._live

    def pending(self) -> list[Scheduled]:
        """Live entries, in no particular order (for quiescence checks)."""
        return [item[2] for item in self._heap if not item[2].cancelled]
