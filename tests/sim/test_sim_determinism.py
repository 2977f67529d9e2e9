"""A seed fully decides a run: the same seed replays the same trace, and worker processes change nothing."""

from __future__ import annotations

from kvstage.sim import SimConfig, run_seed, run_seeds


def test_same_seed_replays_the_same_trace() -> None:
    config = SimConfig(faults="heavy")
    first = run_seed(11, config, keep_trace=True)
    second = run_seed(11, config, keep_trace=True)
    assert first.digest == second.digest
    assert first.trace == second.trace
    assert len(first.trace) > 100
    assert (first.events, first.steps, first.succeeded) == (second.events, second.steps, second.succeeded)


def test_different_seeds_play_different_runs() -> None:
    config = SimConfig(faults="default")
    assert run_seed(1, config, keep_trace=True).digest != run_seed(2, config, keep_trace=True).digest


def test_tracing_does_not_change_the_run() -> None:
    config = SimConfig(faults="heavy", payloads=False)
    traced, plain = run_seed(5, config, keep_trace=True), run_seed(5, config)
    assert (traced.events, traced.steps, traced.failed_by_reason) == (plain.events, plain.steps, plain.failed_by_reason)


def test_worker_processes_give_the_same_summary_as_one_process() -> None:
    config = SimConfig(faults="default", payloads=False)
    one, two = run_seeds(range(12), config, jobs=1), run_seeds(range(12), config, jobs=2)
    keys = ("seeds", "rooms", "succeeded", "failed", "failed_by_reason", "violations", "events")
    assert {k: one.to_json()[k] for k in keys} == {k: two.to_json()[k] for k in keys}
