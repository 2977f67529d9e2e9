"""`PostGate`: posts of writes share it; a library call that would make posts wait inside the library holds it alone.

Why. A bounded write checks its deadline (`PostBy`: its lease, or half of `max_write_s`) and then posts. If the
post can wait inside the library after that check, it may start long after its deadline, so its bytes can land
after decode released their space (R13). NIXL does exactly that: in its RW thread-sync mode, data-path calls run in
parallel but wait for any metadata call, and loading a peer connects to it. Measured (NIXL 1.5.1, UCX over TCP): a
writer's `initialize_xfer` to a reachable peer waited 133 s while `add_remote_agent` of a peer whose SYNs were
dropped ran on another thread. Under the gate, a post's last check and its library calls run while no such call is
under way; a metadata call waits for the posts under way (milliseconds each), and posts that come meanwhile wait for
it before their check.

Invariants: any number of posts, or one exclusive holder, never both; a waiting exclusive holder keeps new posts
out, so a steady stream of posts cannot starve it. No I/O, no clock. Called by `kvstage.transport.data.nixl`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class PostGate:
    """A readers-writer lock whose readers are posts and whose writers are the library's exclusive calls."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._posting = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting: new posts wait behind them

    @contextmanager
    def posting(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive and not self._waiting)
            self._posting += 1
        try:
            yield
        finally:
            with self._changed:
                self._posting -= 1
                if not self._posting:
                    self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._changed:
            self._waiting += 1
            try:
                self._changed.wait_for(lambda: not self._exclusive and not self._posting)
            finally:
                self._waiting -= 1
                self._changed.notify_all()  # posts held back by this waiter, should it give up
            self._exclusive = True
        try:
            yield
        finally:
            with self._changed:
                self._exclusive = False
                self._changed.notify_all()
