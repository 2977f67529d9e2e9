"""Runs many seeded worlds and sums them up: the engine behind `kvstage sim`.

Owns `run_seed` (one world, optionally with its full trace), `run_seeds` (a range of seeds, optionally over
several worker processes, in seed order whatever the worker count) and `Summary`, whose `to_json()` is the
object `kvstage sim --json` prints. Events per second count endpoint events (`handle` calls) over the CPU
(process) time of the worlds, simulator included, so it is a per-core figure however many jobs run and however
loaded the machine is; core events per second divide by the time spent inside the endpoints only (the protocol
core alone; measured in wall time around each call and scaled by the run's CPU/wall ratio).

With `faults="none"` a room that does not succeed is itself a finding: `Summary.violations` then gets an
"L1/none" entry for the seed, so `--faults none` fails loudly unless every room succeeds.

Called by cli.py and tests/sim.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvstage.sim.scenario import SimConfig
from kvstage.sim.world import RunResult, World


def run_seed(seed: int, config: SimConfig, *, keep_trace: bool = False) -> RunResult:
    """Play one seeded world to the end (or its first violation)."""
    return World(seed, config, keep_trace=keep_trace).run()


@dataclass(slots=True)
class Summary:
    """Totals over many seeds."""

    seeds: int = 0
    rooms: int = 0
    succeeded: int = 0
    failed_by_reason: Counter[str] = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0
    steps: int = 0
    cpu_s: float = 0.0
    core_s: float = 0.0

    @property
    def failed(self) -> int:
        return sum(self.failed_by_reason.values())

    @property
    def events_per_second(self) -> float:
        """Endpoint events per CPU second of whole worlds (protocol plus simulator)."""
        return self.events / self.cpu_s if self.cpu_s else 0.0

    @property
    def core_events_per_second(self) -> float:
        """Endpoint events per CPU second spent inside the endpoints alone (the protocol core)."""
        return self.events / self.core_s if self.core_s else 0.0

    def add(self, result: RunResult, faults: str) -> None:
        self.seeds += 1
        self.rooms += result.rooms
        self.succeeded += result.succeeded
        self.failed_by_reason.update(result.failed_by_reason)
        self.events += result.events
        self.steps += result.steps
        self.cpu_s += result.cpu_s
        self.core_s += result.core_s
        for violation in result.violations:
            self.violations.append(
                {
                    "seed": result.seed,
                    "invariant": violation.invariant,
                    "time_ms": round(violation.time * 1000, 3),
                    "detail": violation.detail,
                    "trace": result.trace,
                }
            )
        if faults == "none" and result.succeeded != result.rooms and not result.violations:
            self.violations.append(
                {
                    "seed": result.seed,
                    "invariant": "L1/none",
                    "time_ms": None,
                    "detail": f"fault-free run: only {result.succeeded} of {result.rooms} rooms succeeded "
                    f"({dict(result.failed_by_reason)})",
                    "trace": result.trace,
                }
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "seeds": self.seeds,
            "rooms": self.rooms,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "failed_by_reason": dict(sorted(self.failed_by_reason.items())),
            "violations": [{k: v for k, v in item.items() if k != "trace"} for item in self.violations],
            "events": self.events,
            "events_per_second": round(self.events_per_second, 1),
            "core_events_per_second": round(self.core_events_per_second, 1),
        }


def _run_one(args: tuple[int, SimConfig]) -> RunResult:
    seed, config = args
    return run_seed(seed, config)


def iter_results(seeds: Iterable[int], config: SimConfig, jobs: int = 1) -> Iterator[RunResult]:
    """Results in seed order; with jobs > 1, worlds run in that many worker processes."""
    work = ((seed, config) for seed in seeds)
    if jobs <= 1:
        yield from map(_run_one, work)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with context.Pool(jobs) as pool:
        yield from pool.imap(_run_one, work, chunksize=4)


def run_seeds(
    seeds: Iterable[int],
    config: SimConfig,
    *,
    jobs: int = 1,
    on_result: Callable[[RunResult], None] | None = None,
) -> Summary:
    """Run every seed and sum the results; `on_result` sees each result as it arrives (progress display)."""
    summary = Summary()
    for result in iter_results(seeds, config, jobs):
        summary.add(result, config.profile.name)
        if on_result is not None:
            on_result(result)
    return summary
