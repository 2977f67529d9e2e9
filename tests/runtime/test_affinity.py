"""An agent's threads are not confined to the cores its starting thread is pinned to (runtime/affinity.py)."""

from __future__ import annotations

import os
import threading

import pytest

from kvstage.runtime.affinity import process_cpus, spread_threads

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs CPU masks and 2 CPUs"
)


def _in_pinned_thread(body: object) -> dict[str, set[int]]:
    """Run `body(seen)` on a fresh thread pinned to one CPU, as an engine pins its compute thread."""
    seen: dict[str, set[int]] = {}

    def run() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        seen["pinned"] = set(os.sched_getaffinity(0))
        body(seen)  # type: ignore[operator]
        seen["after"] = set(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen


def _child_mask(seen: dict[str, set[int]], key: str) -> None:
    child = threading.Thread(target=lambda: seen.__setitem__(key, set(os.sched_getaffinity(0))))
    child.start()
    child.join()


def test_threads_started_under_spread_threads_run_on_every_cpu_of_the_process_and_the_caller_stays_pinned() -> None:
    def body(seen: dict[str, set[int]]) -> None:
        _child_mask(seen, "plain")
        with spread_threads("test"):
            _child_mask(seen, "spread")

    seen = _in_pinned_thread(body)
    assert len(seen["pinned"]) == 1
    assert seen["plain"] == seen["pinned"], "a new thread inherits its creator's mask"
    assert seen["spread"] == process_cpus() == set(os.sched_getaffinity(0))
    assert seen["after"] == seen["pinned"]


def test_process_cpus_never_widens_beyond_what_the_process_was_given() -> None:
    assert process_cpus() <= set(range(os.cpu_count() or 1))
    assert set(os.sched_getaffinity(0)) <= process_cpus()
