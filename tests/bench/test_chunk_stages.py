"""`kvstage bench`'s breakdown of a chunk's time from the agents' chunk stamps (bench/stages.py)."""

from __future__ import annotations

import pytest

from kvstage.bench.stages import RankMark, chunk_breakdown

P0, P1, D0 = "P-0", "P-1", "D-0"
DECODE = frozenset({D0})


def _lane(room: int, chunk: int, prefill: str, t0: float) -> list[RankMark]:
    """One writer's chunk: decode grants at t0, prefill issues, gathers, writes; decode takes up its ChunkReady."""
    return [
        (D0, room, chunk, "grant_out", t0, prefill),
        (prefill, room, chunk, "grant_in", t0 + 0.001, D0),
        (prefill, room, chunk, "issued", t0 + 0.002, D0),
        (prefill, room, chunk, "gather_begin", t0 + 0.003, D0),
        (prefill, room, chunk, "gather_end", t0 + 0.005, D0),
        (prefill, room, chunk, "gather_seen", t0 + 0.006, D0),
        (prefill, room, chunk, "posted", t0 + 0.006, D0),
        (prefill, room, chunk, "written", t0 + 0.010, D0),
        (D0, room, chunk, "ready_in", t0 + 0.012, prefill),
    ]


def _scatter(room: int, chunk: int, t0: float) -> list[RankMark]:
    return [
        (D0, room, chunk, "scatter_issued", t0, ""),
        (D0, room, chunk, "scatter_begin", t0 + 0.001, ""),
        (D0, room, chunk, "scatter_end", t0 + 0.003, ""),
        (D0, room, chunk, "landed", t0 + 0.004, ""),
    ]


def test_each_segment_is_the_median_over_lanes_and_a_scatter_waits_for_the_chunks_last_writer() -> None:
    marks = _lane(7, 0, P0, 0.0) + _lane(7, 0, P1, 0.002) + _scatter(7, 0, 0.014)
    out = chunk_breakdown(marks, DECODE)

    assert out["grant hop"] == pytest.approx(0.001)
    assert out["gather"] == pytest.approx(0.002)
    assert out["write"] == pytest.approx(0.004)
    assert out["ready hop"] == pytest.approx(0.002)
    assert out["scatter start"] == pytest.approx(0.014 - 0.014)  # the last ChunkReady (P1's, at 0.014) starts it
    assert out["scatter"] == pytest.approx(0.002)
    assert out["latency"] == pytest.approx(0.018 - 0.002)  # the first write issued (P0's) to landed
    assert out["chunks"] == 1


def test_the_period_is_the_gap_between_one_rooms_successive_chunks_landing() -> None:
    marks = [m for c, t in ((0, 0.0), (1, 0.005), (2, 0.007)) for m in _lane(3, c, P0, t) + _scatter(3, c, t + 0.02)]
    out = chunk_breakdown(marks, DECODE)

    assert out["period"] == pytest.approx(0.0035)  # gaps 0.005 and 0.002
    assert out["chunks"] == 3


def test_a_retried_message_counts_from_its_first_time_and_missing_stages_give_no_segment() -> None:
    marks = _lane(1, 0, P0, 0.0)
    marks.append((D0, 1, 0, "grant_out", 0.0005, P0))  # a retry of the Grant, later
    out = chunk_breakdown(marks, DECODE)

    assert out["grant hop"] == pytest.approx(0.001)
    assert "scatter" not in out and "period" not in out
    assert out["chunks"] == 0
