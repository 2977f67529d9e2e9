"""The pure arithmetic of `kvstage bench --handoff` (bench/handoff_stats.py): release schedules and statistics."""

from __future__ import annotations

import pytest

from kvstage.bench.handoff_stats import (
    chunk_ends,
    cpu_per_chunk_ms,
    interference,
    latency_ms,
    percentile,
    stream_rooms,
    tail_ends,
)


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 95) == pytest.approx(4.8)  # position 3.8: 4 + 0.8 * (5 - 4)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("q", [-1, 101])
def test_percentile_rejects_a_rank_outside_0_to_100(q: float) -> None:
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], q)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_chunk_ends_cover_the_request_and_a_short_last_chunk() -> None:
    assert chunk_ends(4096, 512) == [512 * k for k in range(1, 9)]
    assert chunk_ends(1000, 256) == [256, 512, 768, 1000]


def test_tail_ends_release_the_last_four_chunks_in_one_kv_ready() -> None:
    assert tail_ends(4096, 512) == [512, 1024, 1536, 2048, 4096]
    assert tail_ends(2048, 512) == [2048]  # exactly four chunks: all at once
    with pytest.raises(ValueError, match="fewer than"):
        tail_ends(1536, 512)


def test_stream_rooms_round_up_to_whole_rooms_and_stream_at_least_one() -> None:
    assert stream_rooms(2.0, 500.0, 8) == 125
    assert stream_rooms(1.0, 10.0, 8) == 2  # 10 chunks: a second room for the last two
    assert stream_rooms(0.001, 1.0, 8) == 1


def test_latency_ms_reports_milliseconds() -> None:
    out = latency_ms([0.001, 0.003, 0.002])
    assert out["samples"] == pytest.approx([1.0, 3.0, 2.0])
    assert out["median"] == pytest.approx(2.0)
    assert out["p95"] == pytest.approx(2.9)


def test_cpu_per_chunk_names_the_busiest_rank() -> None:
    out = cpu_per_chunk_ms({"prefill 0": 0.08, "prefill 1": 0.12, "decode 0": 0.04}, chunks=40)
    assert out["per_rank"] == pytest.approx({"prefill 0": 2.0, "prefill 1": 3.0, "decode 0": 1.0})
    assert out["busiest_rank"] == "prefill 1"
    assert out["busiest"] == pytest.approx(3.0)


def test_interference_ratio_is_busy_p99_over_idle_p99() -> None:
    idle = [0.002] * 99 + [0.004]
    busy = [0.003] * 90 + [0.010] * 10
    out = interference(idle, busy)
    assert out["idle_p50_ms"] == pytest.approx(2.0)
    assert out["busy_p50_ms"] == pytest.approx(3.0)
    assert out["idle_p99_ms"] == pytest.approx(2.02)  # position 98.01, between the last 2 ms and the 4 ms step
    assert out["busy_p99_ms"] == pytest.approx(10.0)
    assert out["p99_ratio"] == pytest.approx(10.0 / 2.02)
    assert (out["idle_steps"], out["busy_steps"]) == (100, 100)
