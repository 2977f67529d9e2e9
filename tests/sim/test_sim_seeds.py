"""The simulator's main runs: hundreds of seeds per fault level, every invariant checked after every step."""

from __future__ import annotations

from kvstage.sim import SimConfig

from .conftest import RunClean


def test_default_faults_keep_every_invariant_over_300_seeds(run_clean: RunClean) -> None:
    summary = run_clean(range(300), SimConfig(faults="default"))
    assert summary.rooms == 300 * 12
    # the faults are real: some rooms fail, each for a stated reason, and most still succeed
    assert summary.failed_by_reason["aborted by decode"] > 0
    assert summary.failed_by_reason["transfer failed"] > 0
    assert summary.failed_by_reason["decode crashed"] > 0  # a decode instance crashed with writes in flight
    assert summary.failed_by_reason["lease expired"] > 0  # a stalled writer's queued write was never posted
    assert "unfinished" not in summary.failed_by_reason
    assert summary.succeeded > 0.6 * summary.rooms


def test_heavy_faults_keep_every_invariant_over_50_seeds(run_clean: RunClean) -> None:
    summary = run_clean(range(1000, 1050), SimConfig(faults="heavy"))
    assert summary.failed_by_reason["peer dead"] + summary.failed_by_reason["peer restarted"] > 0
    assert "unfinished" not in summary.failed_by_reason
    assert summary.succeeded > 0


def test_fault_free_world_succeeds_every_room(run_clean: RunClean) -> None:
    summary = run_clean(range(40), SimConfig(faults="none"))
    assert summary.succeeded == summary.rooms == 40 * 12


def test_payloads_off_checks_the_protocol_core_without_bytes(run_clean: RunClean) -> None:
    summary = run_clean(range(40), SimConfig(faults="default", payloads=False))
    assert summary.succeeded > 0.5 * summary.rooms  # (an edge restart takes a prefill instance down in half the seeds)


def test_fan_in_pair_keeps_every_invariant(run_clean: RunClean) -> None:
    summary = run_clean(range(25), SimConfig(faults="default", prefill_tp=4, decode_tp=2, kv_heads=4))
    assert summary.succeeded > 0


def test_fan_out_with_replicated_heads_keeps_every_invariant(run_clean: RunClean) -> None:
    summary = run_clean(range(25), SimConfig(faults="default", prefill_tp=1, decode_tp=4, kv_heads=2))
    assert summary.succeeded > 0


def test_replicated_prefill_heads_keep_every_invariant(run_clean: RunClean) -> None:
    summary = run_clean(range(25), SimConfig(faults="default", prefill_tp=4, decode_tp=1, kv_heads=1))
    assert summary.succeeded > 0


def test_matched_tp_direct_path_keeps_every_invariant(run_clean: RunClean) -> None:
    summary = run_clean(range(25), SimConfig(faults="heavy", prefill_tp=2, decode_tp=2, kv_heads=8))
    assert summary.succeeded > 0


def test_mla_models_take_the_direct_path_under_faults(run_clean: RunClean) -> None:
    summary = run_clean(range(20), SimConfig(faults="heavy", mla_fraction=1.0))
    assert summary.succeeded > 0
    none = run_clean(range(10), SimConfig(faults="none", mla_fraction=1.0))
    assert none.succeeded == none.rooms
