"""Acceptance of the runtime: real processes, real ZeroMQ sockets, real data transports, bit-exact KV.

For each backend (local, mooncake, nixl) and TP pair (P=2->D=1, P=1->D=2, P=4->D=2): 200 rooms of random sizes,
10% aborted (half by decode, half by prefill), run by separate prefill and decode processes
(runtime_worker.py). Every room ends; every room that was not aborted succeeds; each decode rank's digest of
every succeeded room equals the digest the prefill ranks took of the same heads before sending; afterwards every
decode ring is empty and every KV page on both sides is back in its pool. Matched TP (P=D=2) rooms take the
direct path on the backends that can export engine memory (mooncake, nixl), checked the same way.

The crash test kills one prefill rank with SIGKILL while its rooms are mid-transfer: those rooms fail on decode
with "peer dead" within the configured liveness timeout, the ring returns to empty, and a restarted rank (a new
session under the same peer id) serves new rooms. Its mirror kills the decode rank instead: every writer fails
the rooms that were mid-transfer with "peer dead", settles its writes and pages, and serves a restarted decode
rank (whose ring only the new grants may write). There, one writer keeps writing through the kill and the other
writes its held chunks right after it, so rooms end both ways: through the liveness timeout, and through a write
the transport failed because the peer is gone (the backend's cause, `Completion.peer_gone`); both say "peer dead".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import pytest

from kvstage.layout import heads_of_rank
from kvstage.transport.bootstrap import BootstrapServer, PeerRecord

WORKER = Path(__file__).with_name("runtime_worker.py")
LAYOUT = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "dtype": "bfloat16", "page_size": 4}
SEED = 20261129
#: How much of each worker's log a stall shows: room for the stacks of every thread.
STALL_LOG_CHARS = 12000


def _backend_available(backend: str) -> bool:
    module = {"local": "torch", "mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[backend]
    try:
        __import__(module)
    except ImportError:
        return False
    return True


class Directory(Protocol):
    """Where the workers register: a `BootstrapServer` here, or another directory (test_etcd_rooms.py)."""

    @property
    def address(self) -> str: ...

    def records(self) -> list[PeerRecord]: ...

    def close(self) -> None: ...


class Cluster:
    """A directory service (by default a bootstrap in this process) and worker processes around it."""

    def __init__(self, tmp: Path, backend: str, directory: Directory | None = None, **overrides: object) -> None:
        self.tmp = tmp
        self.backend = backend
        self.bootstrap = directory or BootstrapServer().start()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.base = {
            "layout": LAYOUT,
            "backend": backend,
            "bootstrap": self.bootstrap.address,
            "seed": SEED,
            "max_tokens": 64,
            "chunk_tokens": 16,
            "ring_bytes": 64 * 1024,
            "concurrency": 16,
            "abort_fraction": 0.1,
            "room_timeout_s": 60.0,
            "quiesce_timeout_s": 20.0,
            "timing": {"heartbeat_s": 0.2, "dead_after_s": 5.0, "retry_initial_s": 0.05, "retry_max_s": 0.5},
        }
        self.base.update(overrides)

    def spawn(
        self, name: str, role: str, tp: int, rank: int, peer_tp: int, phases: list[dict], instance: str = ""
    ) -> None:
        spec = dict(self.base)
        spec.update(
            role=role,
            instance=instance or ("P" if role == "prefill" else "D"),
            peer_instance="D" if role == "prefill" else "P",
            tp=tp,
            rank=rank,
            peer_tp=peer_tp,
            phases=phases,
        )
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KVSTAGE_TEST_PARENT=str(os.getpid()))
        log = (self.tmp / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(WORKER), str(path)], stdin=subprocess.PIPE, stdout=log, stderr=log, text=True, env=env
        )

    def wait_reports(self, paths: list[Path], timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(p.exists() for p in paths):
                return [json.loads(p.read_text()) for p in paths]
            self.fail_on_exited_worker()
            time.sleep(0.05)
        missing = [p.name for p in paths if not p.exists()]
        pytest.fail(f"no report {missing} after {timeout_s}s:\n{self.stall_report()}")

    def wait_for(self, done: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        """Poll `done` until it holds; fail naming `what`, with every worker's log, if it has not after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not seen after {timeout_s}s:\n{self.stall_report()}")
            self.fail_on_exited_worker()
            time.sleep(0.05)

    def fail_on_exited_worker(self) -> None:
        """Fail at once, with its log, if a worker exited on its own (a worker the test killed does not count)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                pytest.fail(f"worker {name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def stall_report(self) -> str:
        """Every worker's log, after each live worker wrote the Python stack of all its threads into it
        (runtime_worker.py dumps them on SIGUSR1): a stall then shows where each process stood."""
        live = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGUSR1)
        if live:
            time.sleep(1.0)
        return "\n".join(self.log_tail(name, STALL_LOG_CHARS) for name in self.procs)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return f"--- {name}\n" + (self.tmp / f"{name}.log").read_text()[-chars:]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
        for name, proc in self.procs.items():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                report = self.stall_report()
                proc.kill()
                proc.wait(5)
                pytest.fail(f"worker {name} did not exit after stdin closed:\n{report}")
        self.bootstrap.close()


def _phase(tmp: Path, name: str, first_room: int, rooms: int, **extra: object) -> dict:
    return {"first_room": first_room, "rooms": rooms, "report": str(tmp / f"{name}.report"), **extra}


def _check_bit_exact(decode_reports: list[dict], prefill_reports: list[dict], decode_tp: int) -> int:
    """Every succeeded decode room's per-head digest equals a prefill digest of that head; returns rooms checked."""
    h = LAYOUT["num_kv_heads"]
    sent: dict[tuple[str, str], set[str]] = {}
    for report in prefill_reports:
        for room, heads in report["digests"].items():
            for head, digest in heads.items():
                sent.setdefault((room, head), set()).add(digest)
    checked = 0
    for report in decode_reports:
        expected_heads = {str(x) for x in heads_of_rank(h, decode_tp, report["rank"])}
        for room, heads in report["digests"].items():
            assert set(heads) == expected_heads
            for head, digest in heads.items():
                assert digest in sent[(room, head)], f"room {room} head {head} differs on decode rank {report['rank']}"
            checked += 1
    return checked


def _check_outcomes(reports: list[dict], rooms: int) -> set[str]:
    """Every room ended on every rank; rooms not aborted succeeded; failures name an abort. Returns aborted rooms."""
    from runtime_worker import plan_room  # the same seeded plan the workers used

    plans = {str(r): plan_room(SEED, r, 64, LAYOUT["page_size"], 0.1) for r in range(rooms)}
    aborted = {room for room, plan in plans.items() if plan.abort_side}
    assert 0.04 * rooms <= len(aborted) <= 0.2 * rooms
    for report in reports:
        assert set(report["rooms"]) == set(plans), "every room reached an outcome"
        for room, result in report["rooms"].items():
            if room not in aborted:
                assert result["ok"], (report["role"], report["rank"], room, result)
            elif not result["ok"]:
                assert result["reason"] in ("aborted by decode", "aborted by prefill"), result
            if report["role"] == "decode" and not result["ok"]:
                assert result["pages_returned"]
    return aborted


def _check_quiescent(reports: list[dict]) -> None:
    for report in reports:
        assert report["quiescent"], report
        assert report["pages_in_use"] == 0, report
        assert report["ring_live_bytes"] == 0, report
        assert report["rejected_frames"] == 0, report


CRASH_DEAD_AFTER_S = 1.5


def _crash_cluster(tmp: Path, backend: str) -> Cluster:
    """A cluster with a short liveness timeout, rooms of up to 6 chunks and no aborts, for the crash tests."""
    timing = {"heartbeat_s": 0.2, "dead_after_s": CRASH_DEAD_AFTER_S, "retry_initial_s": 0.05, "retry_max_s": 0.5}
    return Cluster(tmp, backend, max_tokens=96, abort_fraction=0.0, timing=timing)


def _wait_registered(cluster: Cluster, peers: set[str]) -> None:
    """Every rank of the crash test is up (on a loaded host, starting the workers can take a minute)."""
    cluster.wait_for(lambda: peers <= {r.peer_id for r in cluster.bootstrap.records()}, f"{sorted(peers)} registered",
                     timeout_s=180)  # fmt: skip


def _session_of(cluster: Cluster, peer: str) -> int:
    return next(r.session for r in cluster.bootstrap.records() if r.peer_id == peer)


def _wait_for_new_session(cluster: Cluster, peer: str, old_session: int) -> None:
    cluster.wait_for(
        lambda: any(r.peer_id == peer and r.session != old_session for r in cluster.bootstrap.records()),
        f"{peer} registered with a new session",
        timeout_s=180,  # a restarted worker can take a minute to start on a loaded host
    )


def _kill_and_restart(
    cluster: Cluster, victim: str, peer: str, crash_reports: list[Path], crash_timeout_s: float, restart: tuple
) -> tuple[float, list[dict], list[dict]]:
    """Kill process `victim` (peer id `peer`) mid-transfer, create the "release" file (a held writer then computes
    the rest of its rooms), wait for the survivors' crash reports, spawn `restart` (`Cluster.spawn` arguments) as
    the peer's next session, then let phase two start (the "phase2" file).

    Returns when the victim was killed, the crash reports, and the phase-two reports of d0, p0 and p1."""
    old_session = _session_of(cluster, peer)
    killed_at = time.time()
    cluster.kill(victim)
    (cluster.tmp / "release").touch()
    crash = cluster.wait_reports(crash_reports, crash_timeout_s)
    cluster.spawn(*restart)
    _wait_for_new_session(cluster, peer, old_session)
    (cluster.tmp / "phase2").touch()
    after = cluster.wait_reports([cluster.tmp / f"{n}.report" for n in ("d0", "p0", "p1")], 90)
    return killed_at, crash, after


def _assert_phase_two_served(after: list[dict]) -> None:
    """Every phase-two room succeeded on d0, p0 and p1, bit-exact, and every rank ended quiescent."""
    for report in after:
        assert all(r["ok"] for r in report["rooms"].values()), report["rooms"]
        assert len(report["rooms"]) == 20
    _check_bit_exact([after[0]], after[1:], 1)
    _check_quiescent(after)


def _assert_failed_as_peer_dead(failed: list[dict], killed_at: float) -> None:
    assert failed, "every multi-chunk room was held mid-transfer, so some must fail"
    for result in failed:
        assert result["reason"] == "peer dead", result
        assert result["t"] - killed_at <= CRASH_DEAD_AFTER_S + 3.0, "failed within the liveness timeout (plus slack)"


BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(not _backend_available(b), reason=f"{b} not installed"))
    for b in ("local", "mooncake", "nixl")
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)], ids=["P2D1", "P1D2", "P4D2"])
def test_rooms_hand_off_bit_exact_across_processes_and_release_everything(tmp_path, backend, prefill_tp, decode_tp):
    rooms = 200
    cluster = Cluster(tmp_path, backend)
    try:
        for rank in range(decode_tp):
            cluster.spawn(f"d{rank}", "decode", decode_tp, rank, prefill_tp, [_phase(tmp_path, f"d{rank}", 0, rooms)])
        for rank in range(prefill_tp):
            cluster.spawn(f"p{rank}", "prefill", prefill_tp, rank, decode_tp, [_phase(tmp_path, f"p{rank}", 0, rooms)])
        decode = cluster.wait_reports([tmp_path / f"d{r}.report" for r in range(decode_tp)], 180)
        prefill = cluster.wait_reports([tmp_path / f"p{r}.report" for r in range(prefill_tp)], 60)
    finally:
        cluster.close()

    aborted = _check_outcomes(decode + prefill, rooms)
    assert _check_bit_exact(decode, prefill, decode_tp) >= decode_tp * (rooms - len(aborted))
    _check_quiescent(decode + prefill)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "local"])
def test_matched_tp_rooms_take_the_direct_path_page_to_page_bit_exact(tmp_path, backend):
    """P == D: no staging; prefill writes each (layer, K/V, page) straight into decode's registered KV pool."""
    rooms = 100
    cluster = Cluster(tmp_path, backend)
    try:
        for rank in range(2):
            cluster.spawn(f"d{rank}", "decode", 2, rank, 2, [_phase(tmp_path, f"d{rank}", 0, rooms)])
        for rank in range(2):
            cluster.spawn(f"p{rank}", "prefill", 2, rank, 2, [_phase(tmp_path, f"p{rank}", 0, rooms)])
        decode = cluster.wait_reports([tmp_path / f"d{r}.report" for r in range(2)], 120)
        prefill = cluster.wait_reports([tmp_path / f"p{r}.report" for r in range(2)], 60)
    finally:
        cluster.close()
    _check_outcomes(decode + prefill, rooms)
    assert _check_bit_exact(decode, prefill, 2) >= 2 * 80
    _check_quiescent(decode + prefill)
    for report in decode:
        assert report["ring_high_water"] == 0, "direct-path rooms never touch the staging ring"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_prefill_rank_fails_its_rooms_as_peer_dead_and_a_restarted_rank_serves_new_rooms(tmp_path, backend):
    cluster = _crash_cluster(tmp_path, backend)
    phase2, held = tmp_path / "phase2", tmp_path / "p1.held"
    try:
        for name, rank in (("d0", None), ("p0", 0)):
            phases = [_phase(tmp_path, f"{name}-crash", 0, 8), _phase(tmp_path, name, 100, 20, wait_for=str(phase2))]
            if rank is None:
                cluster.spawn(name, "decode", 1, 0, 2, phases)
            else:
                cluster.spawn(name, "prefill", 2, rank, 1, phases)
        # p1 writes the first chunk of each room and then stalls, leaving every room mid-transfer
        hold = {"first_room": 0, "rooms": 8, "hold_after_first_chunk": True, "marker": str(held)}
        cluster.spawn("p1", "prefill", 2, 1, 1, [hold])
        _wait_registered(cluster, {"D/0", "P/0", "P/1"})
        cluster.wait_for(held.exists, "p1 holding its rooms after their first chunk")
        killed_at, reports, after = _kill_and_restart(
            cluster, "p1", "P/1", [tmp_path / "d0-crash.report", tmp_path / "p0-crash.report"], 60,
            ("p1-restarted", "prefill", 2, 1, 1, [_phase(tmp_path, "p1", 100, 20)]),
        )  # fmt: skip
    finally:
        cluster.close()

    crash = reports[0]
    failed = [result for result in crash["rooms"].values() if not result["ok"]]
    _assert_failed_as_peer_dead(failed, killed_at)
    assert all(result["pages_returned"] for result in failed)
    assert crash["ring_live_bytes"] == 0 and crash["quiescent"]
    _assert_phase_two_served(after)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_decode_rank_fails_its_rooms_as_peer_dead_on_every_writer_and_a_restarted_rank_serves_new_rooms(
    tmp_path, backend
):
    cluster = _crash_cluster(tmp_path, backend)
    phase2, held = tmp_path / "phase2", tmp_path / "p1.held"
    try:
        cluster.spawn("d0", "decode", 1, 0, 2, [{"first_room": 0, "rooms": 8}])
        cluster.spawn("p0", "prefill", 2, 0, 1, [_phase(tmp_path, "p0-crash", 0, 8), _phase(tmp_path, "p0", 100, 20,
                      wait_for=str(phase2))])  # fmt: skip
        # p1 writes the first chunk of each room and then stalls, leaving every room mid-transfer on decode, with
        # grants of later chunks held; once decode is killed it writes them: into a dead peer's memory
        hold = _phase(tmp_path, "p1-crash", 0, 8, hold_after_first_chunk=True, marker=str(held),
                      release=str(tmp_path / "release"))  # fmt: skip
        cluster.spawn("p1", "prefill", 2, 1, 1, [hold, _phase(tmp_path, "p1", 100, 20, wait_for=str(phase2))])
        _wait_registered(cluster, {"D/0", "P/0", "P/1"})
        cluster.wait_for(held.exists, "p1 holding its rooms after their first chunk")
        killed_at, crash, after = _kill_and_restart(
            cluster, "d0", "D/0", [tmp_path / "p0-crash.report", tmp_path / "p1-crash.report"], 90,
            ("d0-restarted", "decode", 1, 0, 2, [_phase(tmp_path, "d0", 100, 20)]),
        )  # fmt: skip
    finally:
        cluster.close()

    for report in crash:  # rooms of a single chunk may have finished before the kill; the rest were mid-transfer
        assert len(report["rooms"]) == 8
        _assert_failed_as_peer_dead([result for result in report["rooms"].values() if not result["ok"]], killed_at)
        assert report["quiescent"] and report["pages_in_use"] == 0, report
    _assert_phase_two_served(after)
