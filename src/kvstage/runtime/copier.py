"""Gather and scatter off the agent thread: one copy thread per agent, results posted back as events.

Owns `Copier`, a single daemon thread that runs the agent's KV copies (prefill: gather a chunk into local staging;
decode: scatter a chunk from the ring into the KV pool) in submission order, and `CopyDone`, the event it posts
to the agent's queue for each one. torch releases the GIL while it copies, so the agent thread keeps answering
grants, notices and heartbeats while a chunk of tens of MiB is being copied, and gathers/scatters overlap
transfers.

Invariants: every submitted job yields exactly one `CopyDone` (ok, or failed with a reason); a job that raises
`KVStageError` fails that job only, and an unexpected exception is logged with its traceback and also becomes a
failed `CopyDone`, so the thread never dies because of one room. `close` lets queued jobs finish. Called by
runtime/agent.py only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvstage.errors import KVStageError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CopyDone:
    """Job `key` finished: ok, or failed with `reason`; `seconds` is its run time on the copy thread."""

    key: Hashable
    ok: bool
    reason: str
    seconds: float


class Copier:
    """Runs `fn()` jobs in order on one thread; `post(CopyDone)` is called on that thread after each."""

    def __init__(self, post: Callable[[CopyDone], None], name: str = "copier") -> None:
        self._post = post
        self._jobs: queue.SimpleQueue[tuple[Hashable, Callable[[], object]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, fn: Callable[[], object]) -> None:
        self._jobs.put((key, fn))

    def close(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, fn = job
            started = time.perf_counter()
            try:
                fn()
                ok, reason = True, ""
            except KVStageError as exc:
                ok, reason = False, str(exc)
            except Exception as exc:
                log.exception("copy job %r raised", key)
                ok, reason = False, f"internal error: {exc!r}"
            self._post(CopyDone(key, ok, reason, time.perf_counter() - started))
