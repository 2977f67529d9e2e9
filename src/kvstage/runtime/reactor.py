"""How the agent's one thread sleeps and is woken: `Mailbox`, `wait_for_work` and `DeviceWork`.

An agent runs on one reactor thread (agent.py). Everything that reaches it comes through one of two doors, and
this module owns both waits:

- the `Mailbox`: what other threads post (engine calls, bootstrap records from the resolver, imports, the wake-ups
  of a transport whose native calls run on threads of its own). A post appends to a deque and, only while the
  reactor sleeps, writes to an eventfd, so an engine's `kv_ready` costs the engine one append (and at most one
  system call), never a lock the reactor holds;
- the control channel's descriptor (ZeroMQ's edge-triggered `FD`, transport/control.py).

`wait_for_work` sleeps on both with `select`, whose timeout has microsecond resolution (the device work of a chunk
takes tens of microseconds: a poll of its CUDA event every millisecond would add most of a millisecond to each);
where either descriptor is 1024 or above, which `select` refuses, with `poll` (millisecond timeouts).

`DeviceWork` is where the reactor queues its own device work: on a GPU one CUDA stream per agent, current on the
reactor thread for everything it queues (slot lookups' uploads, gathers, scatters), so they run in the order they
were queued and wait only for the events they name (the engine's KV-ready event, a room's pages' event), never for
the engine's whole stream; each job is followed by a `CopyFence`. On the CPU a job runs to completion in place.

Invariants: a post made while the reactor is awake is taken up in the current or next turn, one made while it
sleeps wakes it (the reactor marks itself asleep before it looks at the deque one last time, and posters look at
the mark after appending); a `DeviceWork` job that raises `KVStageError` or anything else fails that job alone,
with a fence after whatever it queued, so one room's bad copy never stops the thread. No lock is taken on the
engine's path. Called by runtime/agent.py (the loop), decode.py and prefill.py (their copies).
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstage.dataplane import LANDED, CopyFence
from kvstage.errors import KVStageError

log = logging.getLogger(__name__)

#: Items one turn takes from the mailbox at most (the rest wait for the next turn, after the socket and timers).
TURN_ITEMS = 1024
#: `select` takes descriptors below this only (FD_SETSIZE); the wait falls back to `poll` past it.
SELECT_FD_LIMIT = 1024


class Mailbox:
    """Items posted to the reactor from any thread, and the eventfd that wakes it while it sleeps."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.asleep = False

    def put(self, item: Any) -> None:
        """Post `item` (any thread); wakes the reactor if it sleeps."""
        self._items.append(item)
        if self.asleep:
            self.wake()

    def wake(self) -> None:
        if self._fd < 0:  # closed: the reactor has ended, nothing waits for the post
            return
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:  # the counter is full, so the reactor is already woken
            log.debug("mailbox: eventfd counter full")

    def __bool__(self) -> bool:
        return bool(self._items)

    def take(self) -> list[Any]:
        """The items posted so far, oldest first, at most TURN_ITEMS."""
        items = self._items
        out: list[Any] = []
        while items and len(out) < TURN_ITEMS:
            out.append(items.popleft())
        return out

    def fileno(self) -> int:
        return self._fd

    def clear(self) -> None:
        """Reset the eventfd after a wake-up."""
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:  # nobody wrote: the wait ended by the socket or the timeout
            return

    def close(self) -> None:
        """Close the eventfd (once the reactor has ended); later posts only append."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class Readable(Protocol):
    """What the reactor waits on besides its mailbox: a descriptor, and whether data is already there."""

    def fileno(self) -> int: ...

    def readable(self) -> bool: ...


def wait_for_work(mailbox: Mailbox, channel: Readable, timeout: float) -> bool:
    """Sleep until a post, a frame or `timeout` seconds (0: do not sleep); whether a frame may be waiting.

    The reactor marks itself asleep before it looks at the mailbox one last time, so a post made after that look
    writes the eventfd; it does not mark itself asleep when it will not sleep, so posts then cost no system call."""
    if timeout > 0:
        mailbox.asleep = True
        try:
            if (
                not mailbox
                and not channel.readable()
                and mailbox.fileno() in _readable((mailbox.fileno(), channel.fileno()), timeout)
            ):
                mailbox.clear()
        finally:
            mailbox.asleep = False
    return channel.readable()


def _readable(fds: tuple[int, ...], timeout: float) -> list[int]:
    """Which of `fds` became readable within `timeout` seconds: `select` (microsecond timeouts) while every
    descriptor is below its limit (FD_SETSIZE, 1024), else `poll`, whose timeout is whole milliseconds (rounded
    up): a process holding many descriptors (an engine's) may give the agent's eventfd or socket a number past it."""
    if max(fds) < SELECT_FD_LIMIT:
        return select.select(fds, [], [], timeout)[0]
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout * 1000)]


@dataclass(frozen=True, slots=True)
class CopyDone:
    """One job of `DeviceWork.run`: ok, or failed with `reason`; `seconds` its host time, `started` its
    `time.perf_counter()` start, and `fence` is done once its copies have landed (`LANDED` on the CPU)."""

    ok: bool
    reason: str
    seconds: float
    fence: CopyFence = LANDED
    started: float = 0.0


class DeviceWork:
    """The reactor's copies: on one CUDA stream of `device` (made current on the reactor thread by `current()`),
    or in place on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._device = device if device.type == "cuda" else None
        self.stream = None if self._device is None else torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]

    def current(self) -> AbstractContextManager[Any]:
        """Make this stream current on the calling thread (the reactor, for its whole life)."""
        return nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def run(self, fn: Callable[[], object], what: str) -> CopyDone:
        """Run `fn` (queue its kernels on the stream, or copy on the CPU) and fence what it queued."""
        started = time.perf_counter()
        try:
            fn()
        except KVStageError as exc:
            return self._failed(str(exc), started)
        except Exception as exc:
            log.exception("%s raised", what)
            return self._failed(f"internal error: {exc!r}", started)
        return CopyDone(True, "", time.perf_counter() - started, self._fence(), started)

    def _fence(self) -> CopyFence:
        return LANDED if self._device is None else CopyFence.record(self._device)

    def _failed(self, reason: str, started: float) -> CopyDone:
        """A failed job may have queued part of its copies: fence them too (LANDED if CUDA itself has failed)."""
        try:
            fence = self._fence()
        except RuntimeError as exc:
            log.error("cannot fence a failed copy on %s: %s", self._device, exc)
            fence = LANDED
        return CopyDone(False, reason, time.perf_counter() - started, fence, started)
