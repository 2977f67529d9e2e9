"""Peers that come and go never exhaust a long-lived decode agent (issue #14, point 4).

One decode agent serves a sequence of prefill instances (TP=2, distinct names, one room each), as autoscaled or
redeployed workers get: most close cleanly, every 20th is a process killed with SIGKILL after its room. Every
room succeeds, and the agent's per-peer tables (bootstrap records, control sockets, resolver entries, parked
sends, the endpoint's peers) follow the peers alive now: with the caps lowered to 16, 100 instances fit only if
each departed peer's state is released.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from deployment import Caps, Deployment, prefill_instance

from kvstage.protocol import Limits
from kvstage.protocol.codec import DEFAULT_MAX_FRAME_BYTES
from kvstage.runtime.outbox import ParkLimits
from kvstage.transport.control import ChannelConfig

WORKER = Path(__file__).with_name("churn_worker.py")
KILL_EVERY = 20


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _killed_instance(deployment: Deployment, name: str, room: int) -> None:
    """Serve `room` from instance `name` in its own process, then SIGKILL that process."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), name, deployment.bootstrap.address, str(room)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180  # starting a process can take a minute on a loaded host
        while {f"{name}/0", f"{name}/1"} - {r.peer_id for r in deployment.bootstrap.records()}:
            assert time.monotonic() < deadline and proc.poll() is None, f"instance {name} never registered"
            time.sleep(0.02)
        pages = deployment.expect(room, name)  # once its ranks are up: decode declares silent room peers dead
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "served", f"instance {name} did not serve room {room}"
        outcome = next(o for o in _poll_until(deployment, room))
        assert outcome.ok, outcome
        deployment.decode.pool.allocator.free(list(pages))
    finally:
        proc.kill()
        proc.wait(60)


def _poll_until(deployment: Deployment, room: int, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for outcome in deployment.decode.poll():
            if outcome.room == room:
                yield outcome
                return
        time.sleep(0.005)
    pytest.fail(f"decode: no outcome for room {room} after {timeout_s}s")


def _wait_tables_below(deployment: Deployment, most: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while max(deployment.tables().values()) > most:
        if time.monotonic() > deadline:
            pytest.fail(f"per-peer tables still hold departed peers after {timeout_s}s: {deployment.tables()}")
        time.sleep(0.02)


def churn(instances: int, caps: Caps, cap: int) -> dict[int, dict[str, int]]:
    """Serve `instances` successive prefill instances; every table stays within `cap`. Returns, at instance 10
    and at the last one, the tables and the RSS of this process (decode agent and the in-process instances)."""
    deployment = Deployment(caps)
    samples: dict[int, dict[str, int]] = {}
    try:
        for i in range(1, instances + 1):
            _wait_tables_below(deployment, cap - 2)  # room for this instance's two ranks
            name = f"P{i}"
            if i % KILL_EVERY == 0:
                _killed_instance(deployment, name, i)
            else:
                prefill = prefill_instance(name, deployment.bootstrap.address)
                try:
                    outcomes = deployment.run_room(i, name, prefill)
                    assert all(o.ok for o in outcomes), (i, outcomes)
                finally:
                    for agent in prefill:
                        agent.close()
            tables = deployment.tables()
            assert max(tables.values()) <= cap, (i, tables)
            if i in (10, instances):
                samples[i] = {**tables, "rss": _rss_bytes()}
        _wait_tables_below(deployment, 0)
    finally:
        deployment.close()
    return samples


def test_a_decode_agent_serves_100_successive_prefill_instances_with_per_peer_caps_of_16() -> None:
    caps = Caps(
        limits=Limits(max_peers=16),
        park=ParkLimits(max_peers=16),
        channel=ChannelConfig(max_frame_bytes=DEFAULT_MAX_FRAME_BYTES, max_peers=16),
    )
    churn(100, caps, cap=16)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_decode_agent_serves_1000_successive_prefill_instances_with_default_caps(capsys) -> None:
    samples = churn(1000, Caps(), cap=ParkLimits().max_peers)
    with capsys.disabled():
        print(f"\nper-peer tables and RSS at instances 10 and 1000: {samples}")
