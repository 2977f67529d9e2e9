"""Peers that come and go never exhaust a long-lived decode agent (issue #14, point 4).

One decode agent, in a process of its own, serves a sequence of prefill instances (TP=2, distinct names, one room
each), as autoscaled or redeployed workers get. The instances live in prefill processes that host them one after
another: every instance closes cleanly after its room, except each process's last (every KILL_EVERY-th instance),
which is killed with its process by SIGKILL. Every room succeeds, and the agent's per-peer tables (bootstrap
records, control sockets, resolver entries, parked sends, the endpoint's peers) follow the peers alive now: with
the caps lowered to 16, 100 instances fit only if each departed peer's state is released.

The soak run (`--run-slow`, never in CI) serves 1,000 instances with the default caps. At instances 10, 100, 500
and 1,000 it prints the decode process's per-peer tables right after the instance, and, once every departed peer
is released, its RSS, open file descriptors and threads; these stay flat (checked). KVSTAGE_CHURN_INSTANCES
changes the count; KVSTAGE_CHURN_TRACEMALLOC=1 adds where Python memory grew since instance 10.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvstage.protocol import Limits
from kvstage.runtime.outbox import ParkLimits
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.control import ChannelConfig

WORKER = Path(__file__).with_name("churn_worker.py")
KILL_EVERY = 20
SAMPLES = (10, 100, 500, 1000)
#: Starting a process can take a minute on a loaded host; a command of a running one takes well under a second.
START_TIMEOUT_S = 180.0
COMMAND_TIMEOUT_S = 60.0
#: The decode process's state right after an instance ("live") and once every departed peer is released ("drained").
Sample = dict[str, dict[str, Any]]
#: File descriptors the decode process may hold, with every departed peer released, beyond those it held so at
#: instance 10 (a ZeroMQ connection, e.g. to the bootstrap, may be reconnecting at that moment).
FD_SLACK = 2
#: RSS the decode process may gain from instance 100 to 1,000, with every departed peer released. Measured: 0.5 MiB,
#: of which Python objects are 0.14 MiB, mostly the endpoint's record of closed rooms (about 85 bytes a room,
#: capped at `Limits.max_closed_rooms`); a leak of 1 KiB per departed peer would add 1.8 MiB.
RSS_GROWTH_BYTES = 4 * 2**20


class Worker:
    """A churn_worker.py process, asked one command at a time."""

    def __init__(self, *args: str) -> None:
        self.name = args[0]
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.started = False

    def ask(self, command: str) -> Any:
        """Send `command`; its reply line (parsed as JSON if it is). The first reply waits for the start-up."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        timeout = COMMAND_TIMEOUT_S if self.started else START_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                pytest.fail(f"{self.name} worker: no reply to {command!r} in {timeout}s")
        line = self.proc.stdout.readline().strip()
        assert line, f"{self.name} worker exited with {self.proc.poll()} on {command!r}"
        self.started = True
        return json.loads(line) if line[0] in "[{" else line

    def close(self) -> None:
        """End its input (it closes its agents and exits) and wait for it."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            self.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)


class Prefill:
    """The prefill processes: the current one, and a spare started ahead (so its start-up overlaps a room)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.current = Worker("prefill", bootstrap)
        self.spare = Worker("prefill", bootstrap)

    def kill_current(self) -> None:
        self.current.kill()
        self.current, self.spare = self.spare, Worker("prefill", self.bootstrap)

    def close(self) -> None:
        try:
            self.current.close()
        finally:
            self.spare.close()


def _wait_tables_below(decode: Worker, most: int, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while max((state := decode.ask("state"))["tables"].values()) > most:
        if time.monotonic() > deadline:
            pytest.fail(f"per-peer tables still hold departed peers after {timeout_s}s: {state['tables']}")
        time.sleep(0.05)
    return state


def serve_instance(decode: Worker, prefill: Prefill, i: int) -> None:
    """Instance P{i} serves room i to decode, then closes cleanly or, every KILL_EVERY-th, is killed."""
    name = f"P{i}"
    assert prefill.current.ask(f"start {name}") == "up"
    assert decode.ask(f"expect {i} {name}") == "ok"  # once its ranks are up: decode declares silent room peers dead
    assert prefill.current.ask(f"room {i}") == "served", f"instance {name}: room {i} failed on prefill"
    assert decode.ask(f"outcome {i}") == [True, ""], f"instance {name}: room {i} failed on decode"
    if i % KILL_EVERY == 0:
        prefill.kill_current()
    else:
        assert prefill.current.ask("close") == "closed"


def churn(instances: int, cap: int, report: Callable[[int, Sample], None] | None = None) -> dict[int, Sample]:
    """Serve `instances` successive prefill instances to one decode agent whose per-peer caps are `cap` (0: the
    defaults); every table stays within the cap. At the SAMPLES instances and the last one, the decode process's
    state right after the instance ("live") and once every departed peer is released ("drained")."""
    limit = cap or min(Limits().max_peers, ParkLimits().max_peers, ChannelConfig().max_peers)
    samples: dict[int, Sample] = {}
    with ExitStack() as running:
        bootstrap = BootstrapServer().start()
        running.callback(bootstrap.close)
        decode = Worker("decode", bootstrap.address, str(cap))
        running.callback(decode.close)
        prefill = Prefill(bootstrap.address)
        running.callback(prefill.close)
        for i in range(1, instances + 1):
            _wait_tables_below(decode, limit - 2)  # room for this instance's two ranks
            serve_instance(decode, prefill, i)
            state = decode.ask("state")
            assert max(state["tables"].values()) <= limit, (i, state)
            if i in SAMPLES or i == instances:
                _wait_tables_below(decode, 0)
                samples[i] = {"live": state, "drained": decode.ask("state growth")}
                if report is not None:
                    report(i, samples[i])
    return samples


def _summary(i: int, sample: Sample) -> str:
    live, drained = sample["live"], sample["drained"]
    extra = {k: v for k, v in drained.items() if k not in ("tables", "fence_records", "rss", "fds", "socket_fds")}
    return (f"instance {i:>5}: tables live {live['tables']}, drained {max(drained['tables'].values())}; "
            f"fence records {drained['fence_records']}; drained RSS {drained['rss'] / 2**20:.1f} MiB, "
            f"fds {drained['fds']} ({drained['socket_fds']} sockets); {json.dumps(extra)}")  # fmt: skip


def test_a_decode_agent_serves_100_successive_prefill_instances_with_per_peer_caps_of_16() -> None:
    samples = churn(100, cap=16)
    assert samples[100]["drained"]["fds"] <= samples[10]["drained"]["fds"] + FD_SLACK, samples


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_a_decode_agent_serves_1000_successive_prefill_instances_with_default_caps(capsys) -> None:
    instances = int(os.environ.get("KVSTAGE_CHURN_INSTANCES", "1000"))
    assert instances >= 100, "the RSS check compares the last instance with instance 100"

    def report(i: int, sample: Sample) -> None:
        with capsys.disabled():
            print(f"\n{_summary(i, sample)}", flush=True)

    samples = churn(instances, cap=0, report=report)
    first, warm, last = samples[10]["drained"], samples[100]["drained"], samples[instances]["drained"]
    assert last["fds"] <= first["fds"] + FD_SLACK, samples
    assert last["threads"] == first["threads"], samples
    assert last["rss"] - warm["rss"] <= RSS_GROWTH_BYTES, samples
