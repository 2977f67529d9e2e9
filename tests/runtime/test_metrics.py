"""Agent metrics: per-agent registries, throughput over the union of busy intervals, failures and rejections."""

from __future__ import annotations

import pytest

from kvstage.runtime.metrics import AgentMetrics, BusyClock


def test_busy_time_is_the_union_of_overlapping_intervals():
    clock = BusyClock()
    clock.begin(0.0)
    clock.begin(1.0)
    assert clock.end(2.0) == 0.0  # another transfer is still in flight
    assert clock.end(3.0) == 3.0  # [0, 3)
    clock.begin(10.0)  # the idle gap [3, 10) does not count
    assert clock.busy_seconds(11.0) == 4.0
    clock.end(12.0)
    assert clock.busy_seconds(100.0) == 5.0


def test_unmatched_end_is_an_error():
    with pytest.raises(ValueError):
        BusyClock().end(1.0)


def test_throughput_divides_bytes_by_busy_time_not_by_summed_latencies():
    m = AgentMetrics("prefill", "p/0")
    m.transfer_started(0.0)
    m.transfer_started(0.0)
    m.transfer_finished(1000, seconds=2.0, ops=1, ok=True, now=2.0)
    m.transfer_finished(1000, seconds=2.0, ops=1, ok=True, now=2.0)
    # two overlapping 2 s transfers of 1000 bytes: 2000 bytes over 2 busy seconds, not over 4
    assert m.value("kvstage_transfer_throughput_bytes_per_second") == pytest.approx(1000.0)
    assert m.value("kvstage_transfer_bytes_total") == 2000
    assert m.value("kvstage_transfer_ops_total") == 2
    assert m.value("kvstage_transfer_seconds_count") == 2


def test_failed_transfer_moves_no_bytes_and_failures_are_counted_by_reason():
    m = AgentMetrics("decode", "d/0")
    m.transfer_started(0.0)
    m.transfer_finished(4096, seconds=0.5, ops=1, ok=False, now=0.5)
    m.room_failed("peer dead")
    m.room_failed("peer dead")
    m.room_failed("timeout")
    m.frame_rejected("oversize")
    assert m.value("kvstage_transfer_bytes_total") == 0
    assert m.value("kvstage_room_failures_total", reason="peer dead") == 2
    assert m.value("kvstage_room_failures_total", reason="timeout") == 1
    assert m.value("kvstage_rejected_frames_total", reason="oversize") == 1


def test_two_agents_in_one_process_keep_separate_registries():
    a, b = AgentMetrics("decode", "d/0"), AgentMetrics("decode", "d/0")
    a.set_ring(100, 200, 50)
    a.set_rooms("open", 3)
    assert b.value("kvstage_ring_live_bytes") == 0
    assert a.value("kvstage_ring_live_bytes") == 100
    assert a.value("kvstage_ring_high_water_bytes") == 200
    assert a.value("kvstage_watermark_lag_bytes") == 50
    assert a.value("kvstage_rooms", state="open") == 3
    text = a.exposition().decode()
    assert 'kvstage_ring_live_bytes{peer="d/0",role="decode"} 100.0' in text
