"""The post gate (kvstage.transport.data.gate): posts share it, an exclusive holder has it alone, and a waiting
exclusive holder keeps new posts out so that a stream of posts cannot starve it."""

from __future__ import annotations

import threading
import time

from kvstage.transport.data.gate import PostGate


def test_posts_share_the_gate_and_an_exclusive_holder_waits_for_them_then_holds_new_posts_back() -> None:
    gate, order = PostGate(), []
    first_in, release_first = threading.Event(), threading.Event()

    def post(name: str, hold: threading.Event | None = None) -> None:
        with gate.posting():
            order.append(f"{name} in")
            if hold is not None:
                first_in.set()
                hold.wait(10)
            order.append(f"{name} out")

    def exclusive() -> None:
        with gate.exclusive():
            order.append("exclusive")

    first = threading.Thread(target=post, args=("first", release_first))
    first.start()
    first_in.wait(10)
    with gate.posting():  # posts share the gate
        order.append("second")
    waiter = threading.Thread(target=exclusive)
    waiter.start()
    time.sleep(0.1)  # the exclusive holder now waits for `first`
    late = threading.Thread(target=post, args=("late",))
    late.start()
    time.sleep(0.1)
    assert order == ["first in", "second"], "an exclusive holder or a later post got in while a post held the gate"
    release_first.set()
    for thread in (first, waiter, late):
        thread.join(10)
    assert order == ["first in", "second", "first out", "exclusive", "late in", "late out"]
