"""The recorded runs of vLLM's scheduler replay on fresh worker sides on the CPU: every decode request gets exactly
its prompt's KV and every report comes at the step it came in the recording (the worker half the GPU tests run,
checked here against the current connector, in vLLM's CPU layout)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_replay import TRACES, Replay, Shape, Trace

from kvstage.transport.bootstrap import BootstrapServer


@pytest.fixture
def bootstrap() -> Iterator[str]:
    server = BootstrapServer().start()
    yield server.address
    server.close()


@pytest.mark.parametrize("name", ["p2d1", "preempt"])
def test_a_recorded_vllm_run_replays_on_fresh_workers_with_every_prompts_kv_intact(bootstrap: str, name: str) -> None:
    trace = Trace.load(TRACES / f"{name}.json")
    replay = Replay(trace, Shape(), bootstrap)
    try:
        replay.run()
    finally:
        replay.close()
    assert sorted(replay.checked) == sorted(c.req_id for step in trace.steps for c in step.checks)
    assert replay.checked, "the recording must have received requests to check"
