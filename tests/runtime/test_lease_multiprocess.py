"""The writer lease across real processes: a writer cut off from decode never lands a write in reused ring space.

Prefill instance P (TP=2) hands rooms to decode rank D/0 (TP=1) over a real data transport. P/1 writes the first
chunk of each room and holds the grant of a later chunk. Then (runtime_worker.py's `cut` phase) P/1 stalls its
data transport, computes the held chunks, and once a write of them waits in its transport, every control frame to
and from P/1 is dropped: its data path stays up and a write of it is still queued. Decode hears nothing from P/1
for `dead_after_s`, declares it dead, fails P's rooms and reuses the ring space for 20 rooms of another prefill
instance, Q. Only then does P/1's transport go on with the queued write.

The lease says that write must not land: P/1 has not heard from decode for longer than `lease_s`, so the transport
refuses it ("lease expired") at the moment it would start moving bytes. The test checks that decode failed P's
mid-transfer rooms as "peer dead", that Q's rooms are bit-exact, that not one byte of decode's ring changed after
Q's rooms ended (the ring's 4 KiB block digests before and after P/1's late write are equal), and that the late
write completed as "lease expired". On the code before the lease (7cdc12c) nothing refuses the late write: it lands
in the reused ring (it did on all three backends; on nixl it can instead fail once the writer has dropped decode's
NIXL agent).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_multiprocess import BACKENDS, Cluster, _check_bit_exact, _phase, _wait_registered

DEAD_AFTER_S = 1.5
Q_ROOMS = 20


def _cut_writer_cluster(tmp: Path, backend: str) -> Cluster:
    timing = {"heartbeat_s": 0.2, "dead_after_s": DEAD_AFTER_S, "retry_initial_s": 0.05, "retry_max_s": 0.5}
    return Cluster(tmp, backend, max_tokens=96, abort_fraction=0.0, timing=timing)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_writer_cut_off_from_decode_never_lands_its_queued_write_after_decode_reused_the_ring_space(
    tmp_path: Path, backend: str
) -> None:
    held, release, cut, unstall, final = (tmp_path / n for n in ("p1.held", "release", "cut", "unstall", "final"))
    cluster = _cut_writer_cluster(tmp_path, backend)
    try:
        cluster.spawn("d0", "decode", 1, 0, 2, [
            _phase(tmp_path, "d0-cut", 0, 8),  # P's rooms: mid-transfer ones fail when P/1 is declared dead
            _phase(tmp_path, "d0-reused", 100, Q_ROOMS, peer_instance="Q"),  # Q's rooms reuse the ring
            _phase(tmp_path, "d0-final", 200, 0, wait_for=str(final)),  # the ring again, after P/1's late write
        ])  # fmt: skip
        cluster.spawn("p0", "prefill", 2, 0, 1, [{"first_room": 0, "rooms": 8}])
        cut_phase = _phase(tmp_path, "p1", 0, 8, hold_after_first_chunk=True, marker=str(held), release=str(release),
                           cut=str(cut), unstall=str(unstall))  # fmt: skip
        cluster.spawn("p1", "prefill", 2, 1, 1, [cut_phase])
        for rank in range(2):  # Q's rooms start once P/1 is cut off (their deadlines must not run out before)
            q_phase = _phase(tmp_path, f"q{rank}", 100, Q_ROOMS, wait_for=str(cut))
            cluster.spawn(f"q{rank}", "prefill", 2, rank, 1, [q_phase], instance="Q")
        _wait_registered(cluster, {"D/0", "P/0", "P/1", "Q/0", "Q/1"})
        cluster.wait_for(held.exists, "p1 holding its rooms after their first chunk")
        release.touch()
        cluster.wait_for(cut.exists, "p1 cut off from decode with a write waiting in its stalled transport")
        reused = cluster.wait_reports([tmp_path / n for n in ("d0-reused.report", "q0.report", "q1.report")], 120)
        [declared] = cluster.wait_reports([tmp_path / "d0-cut.report"], 10)
        unstalled_at = time.time()
        unstall.touch()
        [cut_writer] = cluster.wait_reports([tmp_path / "p1.report"], 60)
        final.touch()
        [after] = cluster.wait_reports([tmp_path / "d0-final.report"], 60)
    finally:
        cluster.close()

    failed = [r["reason"] for r in declared["rooms"].values() if not r["ok"]]
    assert failed and set(failed) == {"peer dead"}, "decode declared the cut writer dead and failed its rooms"
    for report in reused:
        assert len(report["rooms"]) == Q_ROOMS and all(r["ok"] for r in report["rooms"].values()), report["rooms"]
    assert _check_bit_exact(reused[:1], reused[1:], 1) == Q_ROOMS, "every room that reused the ring is bit-exact"
    late = [c for c in cut_writer["completions_after_cut"] if c["t"] >= unstalled_at]
    assert late, "the cut writer's queued write completed after decode had reused its ring space"
    changed = [i for i, (a, b) in enumerate(zip(reused[0]["ring_blocks"], after["ring_blocks"], strict=True)) if a != b]
    assert not changed, f"a late write of the cut writer landed in decode's reused ring (4 KiB blocks {changed})"
    assert all((c["ok"], c["reason"]) == (False, "lease expired") for c in late), late
