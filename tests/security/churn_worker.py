"""The processes of the peer-churn test (test_peer_churn.py), each driven over stdin/stdout, one command a line.

`python churn_worker.py decode BOOTSTRAP CAP` runs the long-lived decode rank "D/0" (TP=1) in a process of its
own, so that the RSS, file descriptors and threads it reports are the agent's alone. CAP lowers its per-peer caps
(`Limits.max_peers`, `ParkLimits.max_peers`, `ChannelConfig.max_peers`); 0 keeps the defaults. Commands:
- `expect ROOM INSTANCE`: admit a room of that prefill instance's two ranks; prints "ok";
- `outcome ROOM`: wait for the room's outcome and return its pages; prints `[ok, reason]` as JSON;
- `state`: the agent's per-peer tables (and its endpoint's fence records, released by rule), RSS,
  open file descriptors (all, and sockets), threads, as JSON. With KVSTAGE_CHURN_TRACEMALLOC=1, `state growth`
  adds, against the first `state growth`: the bytes Python allocated since, by allocating frames, and the objects
  added, by type (a diagnosis of RSS growth; tracing slows the agent down and adds to its RSS).

`python churn_worker.py prefill BOOTSTRAP` hosts successive prefill instances (TP=2, both ranks in this process),
one at a time: `start INSTANCE` (prints "up" once both ranks are registered), `room ROOM` (serves it; prints
"served", or "failed ..."), `close` (closes both ranks cleanly; prints "closed"). The test kills an instance by
sending SIGKILL to its process instead of `close`.

Both die with their parent (PR_SET_PDEATHSIG) and exit at the end of their input.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

from deployment import (
    LAYOUT,
    Caps,
    config,
    expect_room,
    peer_tables,
    prefill_instance,
    start_room,
    wait_outcomes,
)

from kvstage.dataplane import KVPool
from kvstage.protocol import Limits
from kvstage.protocol.codec import DEFAULT_MAX_FRAME_BYTES
from kvstage.runtime import DecodeAgent, PrefillAgent, RoomOutcome
from kvstage.runtime.outbox import ParkLimits
from kvstage.transport.control import ChannelConfig

TRACE_ENV = "KVSTAGE_CHURN_TRACEMALLOC"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _caps(cap: int) -> Caps:
    if cap == 0:
        return Caps()
    return Caps(
        limits=Limits(max_peers=cap),
        park=ParkLimits(max_peers=cap),
        channel=ChannelConfig(max_frame_bytes=DEFAULT_MAX_FRAME_BYTES, max_peers=cap),
    )


def _reply(value: Any) -> None:
    print(value if isinstance(value, str) else json.dumps(value), flush=True)


class _Process:
    """This process's footprint: RSS, file descriptors, threads; with tracing, growth since the first look."""

    def __init__(self) -> None:
        self.tracing = os.environ.get(TRACE_ENV) == "1"
        self._baseline: tuple[tracemalloc.Snapshot, Counter[str]] | None = None
        if self.tracing:
            tracemalloc.start(8)

    def state(self, growth: bool) -> dict[str, Any]:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        fds = _open_files()
        state: dict[str, Any] = {
            "rss": int(status["VmRSS"].split()[0]) * 1024,
            "fds": len(fds),
            "socket_fds": sum(target.startswith("socket:") for target in fds),
            "threads": int(status["Threads"]),
            "python_threads": threading.active_count(),
        }
        if growth and self.tracing:
            state.update(self._growth())
        return state

    def _growth(self) -> dict[str, Any]:
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        types = Counter(type(o).__qualname__ for o in gc.get_objects())
        if self._baseline is None:
            self._baseline = (snapshot, types)
        base_snapshot, base_types = self._baseline
        lines = snapshot.compare_to(base_snapshot, "traceback")
        return {
            "traced": tracemalloc.get_traced_memory()[0],
            "traced_growth": [f"{s.size_diff:+d} B {s.count_diff:+d} at {_where(s.traceback)}" for s in lines[:10]],
            "objects_growth": (types - base_types).most_common(10),
        }


def _open_files() -> list[str]:
    """What each open file descriptor refers to (one closed by another thread meanwhile is left out)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            continue  # closed since the listing (the listing's own descriptor, or another thread's)
    return targets


def _where(traceback: tracemalloc.Traceback) -> str:
    """The allocating frames, the most recent first."""
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(list(traceback)))


def serve_decode(bootstrap: str, cap: int) -> None:
    footprint = _Process()
    agent = DecodeAgent(config("D", 0, 1, bootstrap, _caps(cap)), KVPool.for_rank(LAYOUT, 1, 0, 256)).start()
    pages: dict[int, tuple[int, ...]] = {}
    ended: dict[int, RoomOutcome] = {}
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "expect":
                pages[int(args[0])] = expect_room(agent, int(args[0]), args[1])
                _reply("ok")
            elif command == "outcome":
                outcome = _wait_outcome(agent, int(args[0]), ended)
                agent.pool.allocator.free(list(pages.pop(outcome.room)))
                _reply([outcome.ok, outcome.reason])
            elif command == "state":
                fences = {"fenced": len(agent.endpoint._fenced), "epochs": len(agent.endpoint._epochs)}
                _reply({"tables": peer_tables(agent), "fence_records": fences, **footprint.state(args == ["growth"])})
            else:
                raise ValueError(f"unknown command {line!r}")
    finally:
        agent.close()


def _wait_outcome(agent: DecodeAgent, room: int, ended: dict[int, RoomOutcome], timeout_s: float = 60) -> RoomOutcome:
    deadline = time.monotonic() + timeout_s
    while room not in ended:
        if time.monotonic() > deadline:
            return RoomOutcome(room, False, f"no outcome in {timeout_s}s", ())
        ended.update({o.room: o for o in agent.poll()})
        time.sleep(0.005)
    return ended.pop(room)


def host_prefill(bootstrap: str) -> None:
    agents: list[PrefillAgent] = []
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "start":
                agents = prefill_instance(args[0], bootstrap)
                _reply("up")
            elif command == "room":
                room = int(args[0])
                held = [start_room(agent, room) for agent in agents]
                outcomes = [wait_outcomes(agent, [room])[room] for agent in agents]
                for agent, agent_pages in zip(agents, held, strict=True):
                    agent.pool.allocator.free(agent_pages)
                _reply("served" if all(o.ok for o in outcomes) else f"failed {outcomes}")
            elif command == "close":
                _close(agents)
                agents = []
                _reply("closed")
            else:
                raise ValueError(f"unknown command {line!r}")
    finally:
        _close(agents)


def _close(agents: list[PrefillAgent]) -> None:
    for agent in agents:
        agent.close()


def main() -> None:
    _die_with_parent()
    logging.basicConfig(level=os.environ.get("KVSTAGE_LOG_LEVEL", "WARNING"), format=f"{sys.argv[1]} %(message)s")
    role, bootstrap = sys.argv[1], sys.argv[2]
    if role == "decode":
        serve_decode(bootstrap, int(sys.argv[3]))
    elif role == "prefill":
        host_prefill(bootstrap)
    else:
        raise SystemExit(f"unknown role {role!r}: decode or prefill")


if __name__ == "__main__":
    main()
