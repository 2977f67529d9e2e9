"""kvstage's runtime agents on the mooncake backend across hosts, without vLLM: the layout of test_hosts.py's
cluster (P2 and P1 on host A, D1 and D2 on host B, the bootstrap on C, each host a network namespace of
kvstage.e2e.hosts), one process per TP rank as vLLM runs them, so six Mooncake engines, three per host, start at
once and pairs P2->D1 and P1->D2 hand off 8 rooms each at the same time.

This separates Mooncake's own behaviour between namespaces (several engines per host: their handshake and data
ports, the address each advertises, their segment names) from what vLLM adds: when test_hosts.py's Mooncake cluster
stalled (Mooncake's blocking write call spinning, since replaced; docs/deploy.md, "Which data backend"), this
arrangement still handed off every room in well under a second.

Also a bare transport on each of two hosts (mooncake_cut_peer.py): a write posted while the writer's packets to
the reader are dropped (a one-way cut) must fail and must not land after the heal, which the kernel would make it
do, retransmitting for up to half an hour, without the TCP_USER_TIMEOUT the backend sets on its connections, and
Mooncake would, for slices still in its own queue, without the backend cutting the peer's connections."""

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


CUT_PEER = Path(__file__).with_name("mooncake_cut_peer.py")
#: The writer's max_write_s: its connections to the reader's data port time out after half of it unacknowledged.
MAX_WRITE_S = 4.5
#: How long prefill's packets to decode are dropped: past the write's bound, and past several of the kernel's
#: retransmissions (0.2, 0.6, 1.4, 3.0, 6.2 s after the first send), one of which would deliver it after the heal.
ONE_WAY_CUT_S = 8.0
#: After the heal, the kernel's next retransmission of an unbounded connection comes within this (12.6 s after the
#: first send at the latest); a connection the kernel aborted sends nothing.
AFTER_HEAL_S = 10.0
CUT_BYTES = 4 << 20
WARM_BYTES = 1 << 20
#: Slices of the write posted into the cut: far more than Mooncake's connections to a peer (4 lanes), so that most
#: wait in its own queue for a lane, and for a new connection once the kernel aborted the lanes.
CUT_SLICES = 96


class CutPeer:
    """A mooncake_cut_peer.py process in a host's namespace, one command and one JSON answer at a time."""

    def __init__(self, net: HostNet, host: str, role: str, log: Path, max_write_s: float | None = None) -> None:
        argv = [sys.executable, str(CUT_PEER), role, "--host", net.hosts[host].address, "--bytes", str(CUT_BYTES)]
        if max_write_s is not None:
            argv += ["--max-write-s", str(max_write_s)]
        where = net.placement(host, "")
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                where.argv(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                env={**os.environ, **where.env()}, text=True,
            )  # fmt: skip

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str = "") -> dict[str, object]:
        """The answer to `command` (sent first, if given) or to the last command sent."""
        assert self.proc.stdout is not None
        if command:
            self.send(command)
        line = self.proc.stdout.readline()
        assert line, f"the {command or 'starting'} peer exited ({self.proc.poll()})"
        return dict(json.loads(line))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("slices", [1, CUT_SLICES], ids=["one-slice", "queued-slices"])
def test_a_mooncake_write_posted_into_a_one_way_cut_is_aborted_and_never_lands_after_the_heal(
    tmp_path: Path, slices: int
) -> None:
    """Mooncake's TCP transport has no bound of its own on a posted write: the kernel retransmits unacknowledged
    data for up to half an hour, so a write posted while prefill's packets to decode are dropped lands whenever the
    link heals, long after decode released the space (the canary of test_hosts.py's one-way cut). The backend sets
    TCP_USER_TIMEOUT (half of max_write_s) on its connections to the peer's data port, so the kernel aborts such a
    connection instead (`one-slice`). Slices beyond Mooncake's 4 connections to a peer wait in its own queue, and it
    sends them on a new connection once one succeeds, after the heal too (3,112,960 of 3,145,728 bytes landed so
    before the backend cut the peer's connections until they end: `queued-slices`). Either way the write fails, and
    after the heal the reader's memory still holds its canary."""
    with HostNet(("A", "B")) as net:
        reader = CutPeer(net, "B", "reader", tmp_path / "reader.log")
        writer = CutPeer(net, "A", "writer", tmp_path / "writer.log", max_write_s=MAX_WRITE_S)
        try:
            descriptor = reader.ask()["descriptor"]
            assert writer.ask(f"import {descriptor}")["imported"]
            warm = writer.ask(f"write 0 {WARM_BYTES}")
            assert warm["ok"], warm
            time.sleep(1.0)  # the writer's watcher bounds the warm write's connections within 0.2 s
            net.block("A", "B")
            try:
                writer.send(f"write {WARM_BYTES} {CUT_BYTES - WARM_BYTES} {slices}")
                time.sleep(ONE_WAY_CUT_S)
            finally:
                net.unblock("A")
            cut = writer.ask()
            time.sleep(AFTER_HEAL_S)
            changed = int(reader.ask("changed")["changed"])  # type: ignore[call-overload]
        finally:
            writer.close()
            reader.close()
    assert not cut["ok"], f"the write posted into the cut reported success: {cut}"
    late = changed - WARM_BYTES
    assert late == 0, f"{late} bytes of the write posted into the cut landed after the heal ({cut})"
