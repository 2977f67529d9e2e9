"""Timer bookkeeping of an endpoint: request retries with exponential backoff, and room deadlines.

Owns `Retrier` (R4: every request-type message is re-sent until its answer stops it) and `DeadlineQueue`.
Both are heaps with lazy deletion, so starting, stopping and finding the next due time stay O(log n) however
many rooms are open; entries of a stopped request or a forgotten room never fire and are purged before
`next_due` reports them (Q1: no timer pending for a dead room). Pure: times are supplied by the caller.
Called by base.py (the endpoint core) only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvstage.protocol.messages import RoomBody

#: (kind, peer id, room, chunk): identifies one outstanding request; chunk is 0 for room-level requests.
RetryKey = tuple[str, str, int, int]


@dataclass(slots=True, eq=False)
class _Retry:
    peer: str
    body: RoomBody
    due: float
    delay: float
    serial: int


class Retrier:
    """Outstanding requests, each re-sent at its due time with doubling delay until stopped."""

    __slots__ = ("_by_room", "_entries", "_heap", "_serial", "initial_s", "max_s")

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._entries: dict[RetryKey, _Retry] = {}
        self._by_room: dict[int, dict[RetryKey, None]] = {}
        self._heap: list[tuple[float, int, RetryKey]] = []
        self._serial = 0

    def __len__(self) -> int:
        return len(self._entries)

    def start(self, key: RetryKey, peer: str, body: RoomBody, now: float) -> None:
        """Track `body` (already sent once by the caller); a running entry with the same key is replaced."""
        self._serial += 1
        entry = _Retry(peer, body, now + self.initial_s, self.initial_s, self._serial)
        self._entries[key] = entry
        self._by_room.setdefault(key[2], {})[key] = None
        heapq.heappush(self._heap, (entry.due, entry.serial, key))

    def stop(self, key: RetryKey) -> bool:
        """Stop retrying `key`; True if it was outstanding."""
        if self._entries.pop(key, None) is None:
            return False
        keys = self._by_room[key[2]]
        del keys[key]
        if not keys:
            del self._by_room[key[2]]
        return True

    def stop_room(self, room: int) -> None:
        """Stop every request of `room`."""
        for key in self._by_room.pop(room, {}):
            del self._entries[key]

    def rooms(self) -> frozenset[int]:
        """Rooms with at least one outstanding request."""
        return frozenset(self._by_room)

    def pop_due(self, now: float) -> list[tuple[str, RoomBody]]:
        """(peer, body) of every request due at `now`, each rescheduled with a doubled delay."""
        due: list[tuple[str, RoomBody]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, serial, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is None or entry.serial != serial:
                continue
            due.append((entry.peer, entry.body))
            self._serial += 1
            entry.serial = self._serial
            entry.delay = min(entry.delay * 2, self.max_s)
            entry.due = now + entry.delay
            heapq.heappush(heap, (entry.due, entry.serial, key))
        return due

    def next_due(self) -> float | None:
        heap = self._heap
        while heap:
            _, serial, key = heap[0]
            entry = self._entries.get(key)
            if entry is not None and entry.serial == serial:
                return heap[0][0]
            heapq.heappop(heap)
        return None


class DeadlineQueue:
    """(time, room) alarms; the owner says, when one fires, whether the room still cares."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def push(self, when: float, room: int) -> None:
        heapq.heappush(self._heap, (when, room))

    def pop_due(self, now: float) -> list[tuple[float, int]]:
        due: list[tuple[float, int]] = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap))
        return due

    def entries(self) -> list[tuple[float, int]]:
        """Every alarm, live or stale (for introspection)."""
        return list(self._heap)

    def peek(self) -> tuple[float, int] | None:
        return self._heap[0] if self._heap else None

    def discard_head(self) -> None:
        heapq.heappop(self._heap)
