"""Time in the simulated world: drifting node clocks, the transport's bound on a write, and stalled writers.

A node's timer must never fire before its own clock reaches it (else an endpoint would see a deadline early); a
posted write lands within `max_write_s` of posting or never (the transport's contract that leases rely on); a
writer stalled past the death timeout posts nothing on resuming once its lease ran out.
"""

from __future__ import annotations

import random
from dataclasses import replace

from kvstage.protocol import WriteDirect, WriteRegion
from kvstage.sim import FAULT_LEVELS, SimConfig, World
from kvstage.sim.clock import NodeClock
from kvstage.sim.records import Node

from .conftest import RunClean


def test_a_node_clock_reaches_a_reading_at_the_first_true_time_it_names() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        clock = NodeClock(rng.uniform(1.0, 100.0), 1.0 + rng.uniform(-0.001, 0.001))
        reading = rng.uniform(0.0, 200.0)
        at = clock.when(reading)
        assert clock.read(at) >= reading
        assert at == 0.0 or clock.read(at - 2e-9 * max(1.0, at)) < reading


class RecordsWriteLifetimes(World):
    """Notes when each write was posted and when it landed."""

    lifetimes: list[float]
    posted: dict[tuple[str, int, int], float]

    def _post_write(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        self.posted[(node.peer_id, node.session, action.token)] = self.queue.now
        super()._post_write(node, action)

    def _on_land(self, payload: int) -> None:
        write = self.writes[payload]
        posted = self.posted[(write.writer.peer_id, write.session, write.action.token)]
        self.lifetimes.append(self.queue.now - posted)
        super()._on_land(payload)


def test_a_posted_write_lands_within_max_write_s_or_never() -> None:
    # every write stalls for 0.1-1.5 x max_write_s: those past the bound fail "transfer failed" and never land
    config = SimConfig(faults="none", fault_profile=replace(FAULT_LEVELS["none"], name="stalled", stalled_writes=1.0))
    lifetimes: list[float] = []
    failed = 0
    for seed in range(10):
        world = RecordsWriteLifetimes(seed, config)
        world.lifetimes, world.posted = lifetimes, {}
        result = world.run()
        assert result.violations == []
        failed += result.failed_by_reason["transfer failed"]
    bound = config.timing.max_write_s
    assert lifetimes and max(lifetimes) <= bound
    assert min(lifetimes) >= 0.1 * bound
    assert failed > 0


def test_stalled_writers_fail_their_writes_as_lease_expired_and_land_nothing_late(run_clean: RunClean) -> None:
    profile = replace(FAULT_LEVELS["none"], name="pauses", writer_pauses=3.0, drifting_clocks=True)
    summary = run_clean(range(60), SimConfig(faults="none", fault_profile=profile))
    assert summary.failed_by_reason["lease expired"] > 0
