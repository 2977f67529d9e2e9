"""Gather and scatter off the agent thread: one copy thread per agent, results posted back as events.

Owns `Copier`, a single daemon thread that runs the agent's KV copies (prefill: gather a chunk into local staging;
decode: scatter a chunk from the ring into the KV pool) in submission order, on its own CUDA stream when the KV is
on a GPU, and `CopyDone`, the event it posts to the agent's queue for each one. torch releases the GIL while it
copies, so the agent thread keeps answering grants, notices and heartbeats while a chunk of tens of MiB is being
copied, and gathers/scatters overlap transfers.

On a GPU a job only queues its kernels; the copier records a `CopyFence` (one CUDA event) after each job on its
stream and posts it with the `CopyDone`, without waiting. The agent frees what the copy read or wrote only once
that fence is done (decode polls it), or orders the next device work after it (prefill's write waits for the
gather's event on the device). Each job's stream first waits for the device's default stream, where the engine and
the agent thread queue their work (the slot lookups' uploads among it). On the CPU the fence is `LANDED`.

Invariants: every submitted job yields exactly one `CopyDone` (ok, or failed with a reason), whose fence follows
everything the job queued, also when it failed part way; a job that raises `KVStageError` fails that job only, and
an unexpected exception is logged with its traceback and also becomes a failed `CopyDone`, so the thread never dies
because of one room. `close` lets queued jobs finish. Called by runtime/agent.py, decode.py and prefill.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from kvstage.dataplane import LANDED, CopyFence
from kvstage.errors import KVStageError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CopyDone:
    """Job `key` finished queueing: ok, or failed with `reason`; `seconds` is its run time on the copy thread,
    `started` its `time.perf_counter()` start, and `fence` is done once its copies have landed."""

    key: Hashable
    ok: bool
    reason: str
    seconds: float
    fence: CopyFence = LANDED
    started: float = 0.0


class Copier:
    """Runs `fn()` jobs in order on one thread (on its own stream of `device`, if a GPU); `post(CopyDone)` is called
    on that thread after each."""

    def __init__(
        self, post: Callable[[CopyDone], None], name: str = "copier", device: torch.device | None = None
    ) -> None:
        self._post = post
        self._device = device if device is not None and device.type == "cuda" else None
        self.stream = None if self._device is None else torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
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
            fence = LANDED
            try:
                fence = self._queue(fn)
                ok, reason = True, ""
            except KVStageError as exc:
                ok, reason = False, str(exc)
            except Exception as exc:
                log.exception("copy job %r raised", key)
                ok, reason = False, f"internal error: {exc!r}"
            if not ok:
                fence = self._fence_after_failure()
            self._post(CopyDone(key, ok, reason, time.perf_counter() - started, fence, started))

    def _queue(self, fn: Callable[[], object]) -> CopyFence:
        """Run `fn` (on this copier's stream, after the default stream's work) and fence what it queued."""
        if self.stream is None or self._device is None:
            fn()
            return LANDED
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.default_stream(self._device))
            fn()
            return CopyFence.record(self._device)

    def _fence_after_failure(self) -> CopyFence:
        """A failed job may have queued part of its copies: fence them too (LANDED if CUDA itself has failed)."""
        if self.stream is None or self._device is None:
            return LANDED
        try:
            with torch.cuda.stream(self.stream):
                return CopyFence.record(self._device)
        except RuntimeError as exc:
            log.error("cannot fence a failed copy job on %s: %s", self._device, exc)
            return LANDED
