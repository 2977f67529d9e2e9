"""Soak runs of the simulator: thousands of seeds per fault level, opt-in with `pytest --run-slow`.

The same checks as test_sim_seeds.py over ranges 10-20 times longer (minutes on a 2-core machine, so `make test`
leaves them out). Seeds start past the ranges the quick tests use.
"""

from __future__ import annotations

import pytest

from kvstage.sim import SimConfig

from .conftest import RunClean

pytestmark = pytest.mark.slow


def test_default_faults_keep_every_invariant_over_5000_seeds(run_clean: RunClean) -> None:
    summary = run_clean(range(10_000, 15_000), SimConfig(faults="default"))
    assert "unfinished" not in summary.failed_by_reason
    assert summary.succeeded > 0.6 * summary.rooms


def test_heavy_faults_keep_every_invariant_over_3000_seeds(run_clean: RunClean) -> None:
    summary = run_clean(range(20_000, 23_000), SimConfig(faults="heavy"))
    assert "unfinished" not in summary.failed_by_reason
    assert summary.succeeded > 0


def test_fault_free_world_succeeds_every_room_over_2000_seeds(run_clean: RunClean) -> None:
    summary = run_clean(range(30_000, 32_000), SimConfig(faults="none"))
    assert summary.succeeded == summary.rooms
