"""Agents in separate processes with their directory on a real etcd server (`bootstrap: etcd://...`).

Prefill TP=2 hands rooms to decode TP=1 over the local backend, every rank registered under an etcd lease. One
prefill rank computes only each room's first chunk; with the rooms mid-transfer the test stops etcd, then lets that
rank compute the rest: every room succeeds bit-exact, since a running room needs no lookup, while each rank's
resolver logs that lookups wait for the directory. etcd comes back, new rooms succeed, and a rank killed with
SIGKILL loses its record once its lease runs out while the live ranks keep theirs.
"""

from __future__ import annotations

import time

import pytest
from test_multiprocess import Cluster, _check_bit_exact, _check_quiescent, _phase

from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.etcd import EtcdDirectory

LEASE_S = 3
ROOMS = 8


class EtcdRecords:
    """What `Cluster` needs of its directory, on etcd: the address the workers get and the records seen now."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._reader = EtcdDirectory(address)

    def records(self) -> list[PeerRecord]:
        return self._reader.records()

    def close(self) -> None:
        self._reader.close()


@pytest.mark.timeout(240)
def test_rooms_mid_transfer_when_etcd_stops_succeed_and_a_killed_ranks_record_goes_with_its_lease(tmp_path, etcd):
    directory = EtcdRecords(etcd.address(lease_s=LEASE_S))
    cluster = Cluster(tmp_path, "local", directory, max_tokens=96, abort_fraction=0.0)
    held, resume, phase2 = tmp_path / "p1.held", tmp_path / "resume", tmp_path / "phase2"
    try:
        later = {"wait_for": str(phase2)}
        cluster.spawn(
            "d0", "decode", 1, 0, 2, [_phase(tmp_path, "d0-1", 0, ROOMS), _phase(tmp_path, "d0-2", 100, ROOMS, **later)]
        )
        cluster.spawn(
            "p0",
            "prefill",
            2,
            0,
            1,
            [_phase(tmp_path, "p0-1", 0, ROOMS), _phase(tmp_path, "p0-2", 100, ROOMS, **later)],
        )
        hold = _phase(tmp_path, "p1-1", 0, ROOMS, hold_after_first_chunk=True, marker=str(held), resume=str(resume))
        cluster.spawn("p1", "prefill", 2, 1, 1, [hold, _phase(tmp_path, "p1-2", 100, ROOMS, **later)])
        cluster.wait_for(held.exists, "p1 holding its rooms after their first chunk", timeout_s=180)

        etcd.stop()
        resume.touch()
        first = cluster.wait_reports([tmp_path / f"{n}-1.report" for n in ("d0", "p0", "p1")], 90)
        cluster.wait_for(lambda: _logged_waiting(tmp_path), "a resolver logging that lookups wait for etcd", 30)

        etcd.start()
        phase2.touch()
        second = cluster.wait_reports([tmp_path / f"{n}-2.report" for n in ("d0", "p0", "p1")], 90)

        cluster.kill("p1")
        killed_at = time.monotonic()
        cluster.wait_for(lambda: "P/1" not in _peer_ids(directory), "the killed rank's record gone", 4 * LEASE_S)
        gone_after = time.monotonic() - killed_at
        assert {"D/0", "P/0"} <= _peer_ids(directory), "the live ranks keep renewing their records"
    finally:
        cluster.close()

    for reports in (first, second):
        for report in reports:
            assert len(report["rooms"]) == ROOMS and all(r["ok"] for r in report["rooms"].values()), report["rooms"]
        assert _check_bit_exact([reports[0]], reports[1:], 1) == ROOMS
        _check_quiescent(reports)
    assert gone_after <= LEASE_S + 1.5, f"gone {gone_after:.1f}s after the kill, lease {LEASE_S}s"


def _peer_ids(directory: EtcdRecords) -> set[str]:
    return {r.peer_id for r in directory.records()}


def _logged_waiting(tmp_path) -> bool:
    return any("new peers wait" in (tmp_path / f"{n}.log").read_text() for n in ("d0", "p0", "p1"))
