"""When the engine takes a room's pages back while kvstage may still use them: `PageClaims`.

vLLM frees a preempted request's blocks at once and may write another request's KV into them in the very next
forward pass; sglang frees a request's pages as soon as any TP rank of the instance failed it. A prefill agent
reads those pages on its reactor (the gathers), a decode agent writes them (the scatters), so the engine, before
it reuses them, calls the agent's `reclaim(room)`, and this object makes the answer exact (below, "gather" is
either copy):

- every gather of a room runs inside `reading(room)`, which refuses to start once the room was reclaimed and holds
  one lock while it reads (on the CPU) or queues its kernels and records their event (on a GPU);
- `reclaim(room)` takes the same lock, so it returns only after a gather that was reading has finished (CPU), and
  it hands back the event of the room's last queued gather, which the engine's stream must wait on before it
  writes those pages (GPU; the host never waits);
- the pages' ready event (recorded by the engine after the forward that computed them, `wait_for_save`) is kept
  per room, and a gather's stream waits on it before reading, so no gather reads KV the engine is still writing.

Invariants: after `reclaim(room)` returns, no gather of the room reads its pages, except on the device, ordered
before the returned event; state is kept only for rooms with a gather or a ready event and goes with the room's
outcome (`forget`). Called by runtime/agent.py (`reclaim`, on the engine's thread), runtime/prefill.py and
runtime/decode.py: `reading` and `forget` on the reactor, `set_ready` (prefill) on the engine's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvstage.errors import KVStageError

RECLAIMED = "the engine took the room's pages back (preempted) before this gather"


class PageClaims:
    """See the module docstring. One per prefill agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reclaimed: set[int] = set()
        self._ready: dict[int, torch.cuda.Event] = {}  # room -> event after the engine's latest write of its KV
        self._gathered: dict[int, torch.cuda.Event] = {}  # room -> event after its latest queued gather

    def set_ready(self, room: int, event: torch.cuda.Event | None) -> None:
        """Engine thread: the room's pages hold the KV computed so far once `event` is done (None: on the CPU,
        or the engine synchronised)."""
        if event is not None:
            with self._lock:
                if room not in self._reclaimed:
                    self._ready[room] = event

    @contextmanager
    def reading(self, room: int, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Copy thread: run one gather of `room` inside this block, on `stream` when the KV is on a GPU.
        `KVStageError` (the gather fails, and with it the write) if the engine reclaimed the pages."""
        with self._lock:
            if room in self._reclaimed:
                raise KVStageError(RECLAIMED)
            ready = self._ready.get(room)
            if stream is not None and ready is not None:
                stream.wait_event(ready)
            yield
            if stream is not None:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                self._gathered[room] = event

    def reclaim(self, room: int) -> torch.cuda.Event | None:
        """Engine thread: no gather of `room` starts after this; returns the event that the engine's stream must
        wait on before it writes the room's pages (None on the CPU, where a running gather has finished)."""
        with self._lock:
            self._reclaimed.add(room)
            self._ready.pop(room, None)
            return self._gathered.pop(room, None)

    def forget(self, room: int) -> None:
        """Agent thread: the room ended (its last write completed or failed), so no gather of it is left."""
        with self._lock:
            self._reclaimed.discard(room)
            self._ready.pop(room, None)
            self._gathered.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._reclaimed) + len(self._ready) + len(self._gathered)
