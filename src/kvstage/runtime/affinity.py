"""Where an agent's threads may run: on every CPU its process runs on, not only on the engine thread's cores.

Owns `process_cpus` (the CPUs the threads of this process may use between them) and `spread_threads`, a context
manager under which the calling thread may run on all of them. A new thread takes its creator's CPU mask, so every
thread started inside it (the agent's own, the control channel's I/O thread, the data transport's workers, and the
threads its native library starts: Mooncake's TCP server, NIXL's progress thread, UCX's) is free to run on any of
those CPUs, and so is every thread they start later; the caller's own mask is restored on the way out.

Why. An engine may pin its compute thread to a core: vLLM's CPU backend binds each worker's OpenMP threads, the
worker's main thread included, one rank to one core (`VLLM_CPU_OMP_THREADS_BIND`). Threads the connector started
from that thread inherited the one core, so a TP=1 decode and the TP=2 prefill's rank 0 ran every kvstage thread of
both on core 0 beside their model threads, while the threads of other processes could use both cores (seen on the
2-core test host: all 62 threads of decode's worker on CPU 0 but one OpenMP thread).

The union of the masks of this process's threads is what the process as a whole was allowed (an engine narrows
the masks of some threads, it does not widen any), so spreading never takes a thread outside a `taskset` or cpuset
the operator chose. Where the platform has no CPU masks (not Linux), both are no-ops.
Called by `BaseAgent.start` (agent.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def _parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-2,5") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def process_cpus() -> set[int]:
    """The CPUs the threads of this process may use between them (the union of their masks); the calling
    thread's own mask where /proc does not list the threads."""
    cpus: set[int] = set()
    tasks = Path("/proc/self/task")
    with contextlib.suppress(OSError):  # no procfs: fall back to this thread's mask below
        for task in tasks.iterdir():
            with contextlib.suppress(OSError, ValueError):  # a thread that exited meanwhile
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= _parse_cpu_list(line.split(":", 1)[1])
    return cpus or set(os.sched_getaffinity(0))


@contextlib.contextmanager
def spread_threads(name: str) -> Iterator[None]:
    """Run the body with the calling thread free to use every CPU of `process_cpus`, so that the threads it starts
    are too; restore the caller's mask afterwards. `name` names the caller in the log line."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine = set(os.sched_getaffinity(0))
    wide = process_cpus()
    if wide <= mine:
        yield
        return
    log.info("%s: its threads run on CPUs %s (the starting thread is pinned to %s)", name, _show(wide), _show(mine))
    os.sched_setaffinity(0, wide)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def _show(cpus: set[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))
