"""Prefill's blocks outlive a dead decode instance by seconds, not by the room's deadline (vLLM's sequential flow).

In vLLM's sequential flow prefill computes a prompt before any decode instance is known, attaches its room without a
decode TP size, and holds the prompt's blocks until decode's ranks take the KV. Here two prefill ranks (real
processes, the vLLM connector's default timing: a 20 s liveness timeout for writers, 4 s for decode ranks) hand
rooms to a decode rank that takes them (its Metadata arrive, the first chunk of each lands) and is then killed with
SIGKILL. Each prefill rank must fail the rooms still under way as "peer dead" within 5 s of the kill and give back
every page, with the rooms' own deadline 60 s away. And a decode that never comes (the proxy dropped the request, or
decode's vLLM refused it) costs prefill the claim time (`AttachRoom.claim_s`, the connector's `claim_timeout_s`)
after the prompt is computed, not the room's deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_multiprocess import BACKENDS, Cluster, _phase, _wait_registered

from kvstage.integrations.vllm.settings import ConnectorSettings

#: The decode-death bound of issue 34: prefill frees a dead decode's room this soon after the kill.
FREED_WITHIN_S = 5.0


def _vllm_timing() -> dict[str, float]:
    """The timing the vLLM connector gives its agents by default (ConnectorSettings.timing)."""
    timing = ConnectorSettings(instance="P").timing()
    assert timing.decode_dead_after_s < FREED_WITHIN_S < timing.dead_after_s
    return {"heartbeat_s": timing.heartbeat_s, "dead_after_s": timing.dead_after_s,
            "decode_dead_after_s": timing.decode_dead_after_s, "retry_initial_s": 0.05, "retry_max_s": 0.5}  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_frees_a_sequential_room_within_seconds_of_its_decode_ranks_death(tmp_path: Path, backend) -> None:
    cluster = Cluster(tmp_path, backend, max_tokens=96, abort_fraction=0.0, timing=_vllm_timing())
    held = tmp_path / "p0.held"
    try:
        cluster.spawn("d0", "decode", 1, 0, 2, [{"first_room": 0, "rooms": 8}])
        for rank in range(2):  # each computes the first chunk of every room, then nothing: the rooms stay open
            marker = {"marker": str(held)} if rank == 0 else {}
            phase = _phase(tmp_path, f"p{rank}", 0, 8, sequential=True, hold_after_first_chunk=True, **marker)
            cluster.spawn(f"p{rank}", "prefill", 2, rank, 1, [phase])
        _wait_registered(cluster, {"D/0", "P/0", "P/1"})
        cluster.wait_for(held.exists, "the first chunks landed on decode")
        killed_at = time.time()
        cluster.kill("d0")
        reports = cluster.wait_reports([tmp_path / "p0.report", tmp_path / "p1.report"], 60)
    finally:
        cluster.close()

    for report in reports:
        failed = [result for result in report["rooms"].values() if not result["ok"]]
        assert failed, "rooms of more than one chunk were under way at the kill"
        for result in failed:
            assert result["reason"] == "peer dead", result
            assert result["t"] - killed_at <= FREED_WITHIN_S, f"freed {result['t'] - killed_at:.2f} s after the kill"
        assert report["quiescent"] and report["pages_in_use"] == 0, report


@pytest.mark.timeout(120)
def test_prefill_frees_a_computed_sequential_room_no_decode_ever_takes_after_the_claim_time(tmp_path: Path) -> None:
    claim_s = 2.0
    cluster = Cluster(tmp_path, "local", max_tokens=96, abort_fraction=0.0, timing=_vllm_timing())
    try:
        phase = _phase(tmp_path, "p0", 0, 4, sequential=True, claim_s=claim_s)
        started = time.time()
        cluster.spawn("p0", "prefill", 1, 0, 1, [phase])
        (report,) = cluster.wait_reports([tmp_path / "p0.report"], 90)
    finally:
        cluster.close()
    assert {result["reason"] for result in report["rooms"].values()} == {"unclaimed"}
    assert all(result["t"] - started < 30.0 for result in report["rooms"].values()), "not the 60 s deadline"
    assert report["quiescent"] and report["pages_in_use"] == 0, report
