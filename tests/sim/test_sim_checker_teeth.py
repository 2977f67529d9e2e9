"""The checker has teeth: a world corrupted on purpose, one invariant at a time, is caught with that invariant.

Each test subclasses `World` and breaks one thing the protocol or the engines must never do, then expects the
first violation to name the right invariant. Without these, a checker that never fires would pass every test.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvstage.protocol import AbortRoom, ExpectRoom, KVReady, Scatter, WriteDirect, WriteRegion
from kvstage.protocol.events import Event
from kvstage.ring import Allocation
from kvstage.sim import FAULT_LEVELS, SimConfig, Violation, World
from kvstage.sim.records import Node


def _first_violation(world: type[World], config: SimConfig, seeds: range = range(10)) -> Violation:
    for seed in seeds:
        result = world(seed, config).run()
        if result.violations:
            return result.violations[0]
    raise AssertionError(f"{world.__name__}: no violation in seeds {seeds}")


STAGED = SimConfig(faults="none", prefill_tp=4, decode_tp=2, kv_heads=4)


class WriterIgnoresItsRegion(World):
    """A writer writes its block over the oldest other live region of the decode ring."""

    def _issue_write(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        target = self.nodes[action.peer]
        if isinstance(action, WriteRegion) and target.staging is not None:
            others = [o for o in target.staging.owners() if (o.room, o.chunk) != (str(action.room), action.chunk)]
            if others:
                victim = min(others, key=lambda o: o.epoch)
                region = action.region
                moved = Allocation(region.epoch, region.round, victim.offset, victim.offset + region.nbytes)
                action = dataclasses.replace(action, region=moved)
        super()._issue_write(node, action)


def test_checker_reports_s1_when_a_write_lands_in_another_rooms_region() -> None:
    assert _first_violation(WriterIgnoresItsRegion, STAGED).invariant == "S1"


class RingFreedBeforeScatter(World):
    """The decode side frees a chunk's ring region as soon as it starts scattering it."""

    def _issue_scatter(self, node: Node, action: Scatter) -> None:
        assert node.ring is not None
        node.ring.free(action.region)
        super()._issue_scatter(node, action)


def test_checker_reports_s2_when_a_scatter_reads_freed_staging_bytes() -> None:
    violation = _first_violation(RingFreedBeforeScatter, STAGED)
    assert violation.invariant == "S2" and "freed" in violation.detail


class EnginePagesFreedEarly(World):
    """The decode engine returns a room's KV pages right after admitting it, while transfers still target them."""

    def _admit_decode_room(self, room: int, nodes: list[Node], count: int) -> None:
        super()._admit_decode_room(room, nodes, count)
        state = self.rooms[room]
        for node in nodes:
            assert node.pool is not None
            node.pool.free(state.decode_pages[node.rank], str(room))


def test_checker_reports_s2_when_a_scatter_writes_released_pages() -> None:
    violation = _first_violation(EnginePagesFreedEarly, STAGED)
    assert violation.invariant == "S2" and "scatter" in violation.detail


def test_checker_reports_w1_when_a_direct_write_lands_in_released_pages() -> None:
    violation = _first_violation(EnginePagesFreedEarly, SimConfig(faults="none", prefill_tp=2, decode_tp=2, kv_heads=2))
    assert violation.invariant == "W1" and "direct write" in violation.detail


class TransferFlipsABit(World):
    """Every bulk or direct write corrupts one KV word but reports success."""

    def _gather(self, node: Node, action: WriteRegion | WriteDirect) -> object:
        payload = super()._gather(node, action)
        if isinstance(payload, bytes):
            return bytes([payload[0] ^ 1]) + payload[1:]
        assert isinstance(payload, np.ndarray)
        flipped = payload.copy()
        flipped.flat[0] ^= 1
        return flipped


def test_checker_reports_d1_when_succeeded_kv_differs_by_one_bit() -> None:
    violation = _first_violation(TransferFlipsABit, SimConfig(faults="none"))
    assert violation.invariant == "D1"


class PrefillGivesNoAuxRow(World):
    """The prefill engine's completing KVReady carries no aux row (or, on the wire, the aux row is lost)."""

    def feed(self, node: Node, event: Event) -> None:
        super().feed(node, dataclasses.replace(event, aux=b"") if isinstance(event, KVReady) else event)


def test_checker_reports_d1_when_a_room_succeeds_without_prefills_aux_row() -> None:
    violation = _first_violation(PrefillGivesNoAuxRow, SimConfig(faults="none", payloads=False))
    assert violation.invariant == "D1" and "aux row b''" in violation.detail


def test_d1_needs_payloads_so_the_corruption_goes_unseen_without_them() -> None:
    result = TransferFlipsABit(0, SimConfig(faults="none", payloads=False)).run()
    assert result.violations == [] and result.succeeded == result.rooms


class DecodeRankHangs(World):
    """Decode rank D0.0 stops processing anything after 50 ms (a wedged thread), silently."""

    def feed(self, node: Node, event: Event) -> None:
        if node.peer_id == "D0.0" and self.queue.now > 0.05:
            return
        super().feed(node, event)


def test_checker_reports_l1_when_a_room_outlives_its_deadline() -> None:
    violation = _first_violation(DecodeRankHangs, SimConfig(faults="none"))
    assert violation.invariant == "L1" and "past its deadline" in violation.detail


class RingLeak(World):
    """The first scatter on each decode rank leaks one ring allocation behind the endpoint's back."""

    def _issue_scatter(self, node: Node, action: Scatter) -> None:
        assert node.ring is not None
        if node.ring.num_live and not any(a.nbytes == 1 for a in node.ring.live()):
            node.ring.allocate(1)
        super()._issue_scatter(node, action)


def test_checker_reports_q1_when_a_ring_allocation_leaks() -> None:
    violation = _first_violation(RingLeak, STAGED)
    assert violation.invariant == "Q1" and "ring still holds" in violation.detail


class EngineInventsARoom(World):
    """At the first arrival, decode rank D0.0 is handed a room the world never created."""

    def _on_arrive(self, payload: object) -> None:
        super()._on_arrive(payload)
        if payload == 0:
            node = self.nodes["D0.0"]
            plan = self.scenario.rooms[0]
            peers = tuple(f"P{plan.prefill}.{r}" for r in range(self.prefill[plan.prefill].tp))
            self.feed(node, ExpectRoom(10**9, peers, 4, 0, (0,), plan.deadline))


def test_checker_reports_b1_when_an_endpoint_holds_a_room_nobody_created() -> None:
    violation = _first_violation(EngineInventsARoom, SimConfig(faults="none", decode_tp=1, kv_heads=2))
    assert violation.invariant == "B1"


def test_hostile_frames_are_rejected_and_counted_without_growing_state() -> None:
    config = SimConfig(faults="heavy")
    rejected = 0
    for seed in range(10):
        world = World(seed, config)
        result = world.run()
        assert result.violations == []
        for node in world.nodes.values():
            if node.endpoint is not None:
                stats = node.endpoint.stats.snapshot()
                rejected += stats["frames_rejected"] + stats["messages_rejected"] + stats["stale_dropped"]
    assert world.checker.hostile_sent > 0
    assert rejected > 0


class EngineAbortsAnUnknownRoom(World):
    """At the first arrival, the decode engine aborts a room it never registered: the endpoint raises."""

    def _on_arrive(self, room: int) -> None:
        super()._on_arrive(room)
        if room == 0:
            self.feed(self.nodes["D0.0"], AbortRoom(10**9))


def test_an_endpoint_that_raises_is_reported_with_its_seed_not_a_traceback() -> None:
    violation = _first_violation(EngineAbortsAnUnknownRoom, SimConfig(faults="none"))
    assert violation.invariant == "crash" and "InvalidRequest" in violation.detail


class QuarantineIgnored(World):
    """When a decode rank fails a room, its ring regions are freed at once, while writes may still be in flight."""

    def _room_failed(self, node: Node, room: int, reason: str) -> None:
        if node.ring is not None and node.staging is not None:
            mine = {owner.epoch for owner in node.staging.owners() if owner.room == str(room)}
            for allocation in node.ring.live():
                if allocation.epoch in mine:
                    node.ring.free(allocation)
        super()._room_failed(node, room, reason)


def test_checker_reports_w1_when_a_late_write_lands_in_space_released_before_the_writer_confirmed() -> None:
    # message faults and aborts only: no process fault that could land a late write on its own
    profile = dataclasses.replace(
        FAULT_LEVELS["none"], loss=0.05, duplicate=0.02, delay_jitter=0.004, abort_rooms=0.5, slow_writes=0.3
    )
    config = SimConfig(prefill_tp=4, decode_tp=2, kv_heads=4, fault_profile=profile)
    violation = _first_violation(QuarantineIgnored, config, range(40))
    assert violation.invariant == "W1" and "after its region was freed" in violation.detail
