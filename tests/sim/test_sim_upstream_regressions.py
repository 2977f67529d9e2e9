"""One seeded simulator scenario per upstream bug (sgl-project/sglang issue or PR numbers), each isolating its fault.

Every scenario starts from a fault-free world and turns on exactly the fault that triggered the bug upstream,
then requires every invariant to hold (S1, S2, D1, L1, Q1, B1 after every step) plus the outcome the fix
promises. Bugs of the runtime layer rather than the protocol (#29984 concurrent socket sends, #26501
CUDA-only events, the blocking-send half of #36049/#34737) have their regression tests in tests/runtime.
"""

from __future__ import annotations

from dataclasses import replace

from kvstage.sim import FAULT_LEVELS, SimConfig, World

from .conftest import RunClean

CLEAN = FAULT_LEVELS["none"]


def _config(**faults: float) -> SimConfig:
    return SimConfig(faults="none", fault_profile=replace(CLEAN, name="regression", **faults))


def test_31217_aborted_rooms_release_everything_and_never_wedge_the_rank(run_clean: RunClean) -> None:
    # half the rooms aborted, from either side: Q1 proves ring space and pages all came back, and the rooms
    # that were not aborted still succeed (a leak would pin the watermark and time them out)
    summary = run_clean(range(40), _config(abort_rooms=0.5))
    aborted = summary.failed_by_reason["aborted by decode"] + summary.failed_by_reason["aborted by prefill"]
    assert aborted > 0.2 * summary.rooms
    assert summary.failed == aborted
    assert summary.succeeded > 0.3 * summary.rooms


def test_31217_a_chunk_larger_than_the_ring_fails_its_room_at_once(run_clean: RunClean) -> None:
    # the ring holds half the largest chunk: staged rooms with big chunks fail "staging oversized" (no silent
    # fallback to another path), and every other room is unaffected
    summary = run_clean(range(30), _config(ring_chunks=0.5))
    assert summary.failed_by_reason["staging oversized"] > 0
    assert set(summary.failed_by_reason) == {"staging oversized"}
    assert summary.succeeded > 0


def test_31217_failed_sends_fail_their_room_only(run_clean: RunClean) -> None:
    summary = run_clean(range(40), _config(send_failure=0.01))
    assert summary.failed_by_reason["send failed"] > 0
    assert summary.succeeded > 0.5 * summary.rooms


def test_30545_prefix_cache_hits_cut_sends_to_grid_slots(run_clean: RunClean) -> None:
    # every room has a decode-side cached prefix: only the suffix moves, on a grid starting at the prefix, and
    # D1 proves every token landed in the right page
    config = replace(_config(), prefix_fraction=1.0)
    summary = run_clean(range(40), config)
    assert summary.succeeded == summary.rooms


def test_37166_a_ring_of_one_chunk_wraps_and_never_waits_forever(run_clean: RunClean) -> None:
    summary = run_clean(range(40), _config(ring_chunks=1.0))
    assert summary.succeeded == summary.rooms


def test_29978_lost_control_messages_never_stall_a_room(run_clean: RunClean) -> None:
    # 20% of control messages lost: retries with backoff carry every room to success before its deadline
    summary = run_clean(range(40), _config(loss=0.2))
    assert summary.succeeded == summary.rooms


def test_36049_dead_and_restarted_peers_are_pruned_and_served_again(run_clean: RunClean) -> None:
    # prefill instances crash and come back with new sessions: rooms on the dead incarnation fail with a stated
    # reason, Q1 proves nothing of the dead peer stays behind, and rooms arriving later succeed
    summary = run_clean(range(40), _config(prefill_crashes=2))
    assert summary.failed_by_reason["peer dead"] + summary.failed_by_reason["peer restarted"] > 0
    assert summary.succeeded > 0.3 * summary.rooms


def test_37697_chunks_arriving_in_any_order_complete_the_room(run_clean: RunClean) -> None:
    # long random delays and duplicates reorder grants, chunk notices and acks arbitrarily
    summary = run_clean(range(40), _config(delay_jitter=0.03, duplicate=0.2))
    assert summary.succeeded == summary.rooms


def test_36707_an_abort_is_acknowledged_only_when_no_write_can_land(run_clean: RunClean) -> None:
    # many aborts while slow writes are in flight, and a small ring so freed space is reused at once: a late
    # write into re-granted space would violate S1 (or S2 for direct-path pages)
    summary = run_clean(range(60), _config(abort_rooms=0.6, delay_jitter=0.02, ring_chunks=1.5))
    assert summary.failed > 0 and summary.succeeded > 0


def test_39764_hostile_indices_from_the_wire_allocate_nothing() -> None:
    config = _config(hostile_frames=0.5)
    rejected = 0
    for seed in range(20):
        world = World(seed, config)
        result = world.run()
        assert result.violations == [], result.trace
        assert result.succeeded == result.rooms
        for node in world.nodes.values():
            assert node.endpoint is not None
            stats = node.endpoint.stats.snapshot()
            rejected += stats["frames_rejected"] + stats["messages_rejected"] + stats["stale_dropped"]
    assert rejected >= 20 * 50 * 0.5


def test_r11_pools_of_one_room_and_a_ring_of_one_chunk_never_deadlock(run_clean: RunClean) -> None:
    # the tightest world: each side's KV pool holds one longest room, the ring one largest chunk; staging is
    # requested in production order, so no grant ever waits on a chunk that cannot be computed
    config = replace(_config(ring_chunks=1.0), prefill_pool_rooms=1, decode_pool_rooms=1)
    summary = run_clean(range(40), config)
    assert summary.succeeded == summary.rooms
