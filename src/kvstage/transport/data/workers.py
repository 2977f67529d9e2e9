"""Background threads that run blocking transfer jobs for a data backend and collect their completions.

Owns: a fixed set of daemon threads, the queue of jobs waiting for them, and the list of completions they have
produced and `drain` has not yet returned.

Invariants: every submitted job yields exactly one `Completion`, made by the backend's `run` function; `run`
turns transport errors into failed completions itself, and an error that escapes it anyway (a bug) is logged and
becomes a failed completion too, so a worker thread never dies because one transfer failed. `stop` lets queued
jobs finish, then joins the threads.

Used by the backends whose native calls block: `mooncake` (whose Python binding only offers blocking
status checks for batches) and `nixl` (whose UCX backend copies a same-host write inside the posting call).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvstage.transport.data.base import Completion

log = logging.getLogger(__name__)


class Job(Protocol):
    """A unit of work: its transfer id and the number of operations it carries."""

    @property
    def transfer_id(self) -> int: ...

    @property
    def ops(self) -> int: ...


J = TypeVar("J", bound=Job)


class JobRunner(Generic[J]):
    """`threads` workers each calling `run(job)` for queued jobs; completions come back through `drain`, and
    `notify()` (if given) is called on the worker thread after each one is ready."""

    def __init__(
        self, name: str, run: Callable[[J], Completion], threads: int = 1, notify: Callable[[], None] | None = None
    ) -> None:
        self._run = run
        self._notify = notify
        self._jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self._done: list[Completion] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: J) -> None:
        self._jobs.put(job)

    def drain(self) -> list[Completion]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def stop(self, timeout: float = 30.0) -> None:
        """Finish queued jobs, then end the threads (waiting at most `timeout` seconds for each)."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("transfer worker %s still busy after %.0f s; leaving it to exit", thread.name, timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                completion = self._run(job)
            except Exception as err:  # a backend bug must not kill the worker: the transfer fails instead
                log.exception("transfer %d raised out of its backend", job.transfer_id)
                completion = Completion(job.transfer_id, False, f"internal error in transfer worker: {err!r}", job.ops)
            with self._lock:
                self._done.append(completion)
            if self._notify is not None:
                self._notify()
