"""kvstage's runtime agents on the mooncake backend across hosts, without vLLM: the layout of test_hosts.py's
cluster (P2 and P1 on host A, D1 and D2 on host B, the bootstrap on C, each host a network namespace of
kvstage.e2e.hosts), one process per TP rank as vLLM runs them, so six Mooncake engines, three per host, start at
once and pairs P2->D1 and P1->D2 hand off 8 rooms each at the same time.

This separates Mooncake's own behaviour between namespaces (several engines per host: their handshake and data
ports, the address each advertises, their segment names) from what vLLM adds: in test_hosts.py's Mooncake cluster
writes stalled until Mooncake's 30 s progress timeout in 3 of 4 runs, while this arrangement hands off every room
in well under a second (docs/deploy.md, "Which data backend")."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstage.e2e.hosts import HostNet, namespaces_refused
from kvstage.e2e.servers import start_bootstrap

REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"no multi-host harness here: {REFUSED}")
pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")

RANK = Path(__file__).with_name("mooncake_rank.py")
#: name -> (role, TP, host, the other side of its pair, its rooms)
LAYOUT = {
    "P2": ("prefill", 2, "A", "D1", range(1, 9)),
    "P1": ("prefill", 1, "A", "D2", range(101, 109)),
    "D1": ("decode", 1, "B", "P2", range(1, 9)),
    "D2": ("decode", 2, "B", "P1", range(101, 109)),
}
TOKENS = 320  # three 128-token chunks, as test_hosts.py's prompts
ROOM_TIMEOUT_S = 60.0


@pytest.mark.timeout(240)
def test_six_mooncake_engines_on_two_hosts_hand_off_every_room_of_both_pairs_bit_exact(tmp_path: Path) -> None:
    with HostNet() as net:
        secret = secrets.token_hex(16)
        where = {name: net.placement(name, secret) for name in "ABC"}
        bootstrap = start_bootstrap(tmp_path, where["C"])
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            bootstrap.wait_ready(60.0)
            for name, (role, tp, host, peer, rooms) in LAYOUT.items():
                for rank in range(tp):
                    argv = where[host].argv([
                        sys.executable, str(RANK), role, name, str(rank), str(tp), "--host", where[host].address,
                        "--bootstrap", bootstrap.url, "--peer", f"{peer}:{LAYOUT[peer][1]}",
                        "--rooms", ",".join(map(str, rooms)), "--tokens", str(TOKENS),
                        "--timeout", str(ROOM_TIMEOUT_S), "--linger", "3" if role == "prefill" else "0",
                        "--out", str(tmp_path / f"{name}-{rank}.json"),
                    ])  # fmt: skip
                    log = (tmp_path / f"{name}-{rank}.log").open("wb")
                    env = {**os.environ, **where[host].env()}
                    procs[f"{name}/{rank}"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + ROOM_TIMEOUT_S + 90.0
            for proc in procs.values():
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        finally:
            for proc in procs.values():
                proc.kill()
            bootstrap.stop()
    results = {}
    for peer_id, proc in procs.items():
        out = tmp_path / f"{peer_id.replace('/', '-')}.json"
        log = (tmp_path / f"{peer_id.replace('/', '-')}.log").read_text(errors="replace")
        assert proc.returncode == 0 and out.exists(), f"{peer_id} exited {proc.returncode}:\n{log[-3000:]}"
        results[peer_id] = json.loads(out.read_text())
    sessions = {peer_id: r["session"] for peer_id, r in results.items()}
    assert len(set(sessions.values())) == len(sessions), f"two engines share a session: {sessions}"
    for peer_id, session in sessions.items():
        address = net.hosts[LAYOUT[peer_id.split("/")[0]][2]].address
        assert session.rsplit(":", 1)[0] == address, f"{peer_id} advertises {session}, not its host's {address}"
    for peer_id, r in results.items():
        rooms = {str(room) for room in LAYOUT[peer_id.split("/")[0]][4]}
        failed = {room: reason for room, (ok, reason) in r["outcomes"].items() if not ok}
        assert set(r["outcomes"]) == rooms and not failed, f"{peer_id}: outcomes {r['outcomes']}"
        if LAYOUT[peer_id.split("/")[0]][0] == "decode":
            assert r["verified"] == dict.fromkeys(rooms, True), f"{peer_id}: KV differs in {r['verified']}"
