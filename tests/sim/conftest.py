"""Shared helpers of the simulator tests: run seeds and explain any violation in the assertion message."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstage.sim import SimConfig, Summary, run_seeds

RunClean = Callable[[range, SimConfig], Summary]


def explain(summary: Summary) -> str:
    """The first violations with their traces, for an assertion message."""
    lines: list[str] = []
    for violation in summary.violations[:2]:
        lines.append(f"seed {violation['seed']}: {violation['invariant']}: {violation['detail']}")
        lines.extend(violation["trace"][-30:])
    return "\n".join(lines)


def _run_clean(seeds: range, config: SimConfig) -> Summary:
    summary = run_seeds(seeds, config)
    assert not summary.violations, explain(summary)
    return summary


@pytest.fixture
def run_clean() -> RunClean:
    """Run seeds and assert that no invariant was violated (the message shows the seed and its trace)."""
    return _run_clean
