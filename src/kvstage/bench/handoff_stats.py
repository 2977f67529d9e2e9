"""The pure arithmetic of `kvstage bench --handoff` (bench/handoff.py): chunk release schedules and the statistics
of its samples.

Owns `chunk_ends` and `tail_ends` (what each `kv_ready` says), `stream_rooms` (how many rooms the interference
phase streams), `percentile` (linear interpolation between closest ranks, numpy's default) and the JSON shapes of
the scenario's results: `latency_ms`, `cpu_per_chunk_ms`, `interference`. Pure: no I/O, no clock, no kvstage
import, so that benchmarks/handoff_ab.py can run it, with bench/handoff.py, against any git ref's `kvstage`.
Called by bench/handoff.py and bench/report.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

#: The chunks that become ready at once in the "tail with 4 ready" scenario.
TAIL_CHUNKS = 4


def chunk_ends(tokens: int, chunk_tokens: int) -> list[int]:
    """End token of each chunk: what `kv_ready` says when that chunk's KV is computed."""
    return [min(end, tokens) for end in range(chunk_tokens, tokens + chunk_tokens, chunk_tokens)]


def tail_ends(tokens: int, chunk_tokens: int, tail: int = TAIL_CHUNKS) -> list[int]:
    """Chunks released one by one, except the last `tail`, which become ready in one `kv_ready`."""
    ends = chunk_ends(tokens, chunk_tokens)
    if len(ends) < tail:
        raise ValueError(f"{len(ends)} chunks, fewer than the {tail} of the tail")
    return [*ends[: len(ends) - tail], tokens]


def stream_rooms(stream_s: float, chunk_rate_hz: float, chunks: int) -> int:
    """Rooms streamed back to back in phase B: enough chunks for `stream_s` at `chunk_rate_hz`, at least one."""
    return max(1, math.ceil(stream_s * chunk_rate_hz / chunks))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_ms(seconds: Sequence[float]) -> dict[str, Any]:
    """Median and p95 of samples in seconds, and the samples themselves, all in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "p95": percentile(ms, 95), "samples": ms}


def cpu_per_chunk_ms(cpu_s: dict[str, float], chunks: int) -> dict[str, Any]:
    """Per rank, CPU milliseconds per chunk handled; the busiest rank's, and which it is."""
    per_rank = {rank: seconds * 1e3 / chunks for rank, seconds in cpu_s.items()}
    busiest = max(per_rank, key=lambda rank: per_rank[rank])
    return {"busiest": per_rank[busiest], "busiest_rank": busiest, "per_rank": per_rank}


def interference(idle_s: Sequence[float], busy_s: Sequence[float]) -> dict[str, float]:
    """Engine step time, p50 and p99 in ms, with no transfer (idle) and while rooms stream (busy)."""
    idle_p99, busy_p99 = percentile(idle_s, 99) * 1e3, percentile(busy_s, 99) * 1e3
    return {
        "idle_p50_ms": percentile(idle_s, 50) * 1e3,
        "idle_p99_ms": idle_p99,
        "busy_p50_ms": percentile(busy_s, 50) * 1e3,
        "busy_p99_ms": busy_p99,
        "p99_ratio": busy_p99 / idle_p99,
        "idle_steps": len(idle_s),
        "busy_steps": len(busy_s),
    }


#: One chunk mark of a rank: (room, chunk, stage, `time.monotonic()`).
Mark = tuple[int, int, str, float]


def stage_offsets_ms(marks: Sequence[Mark], chunks: int) -> dict[str, float]:
    """Where a room's last chunk spends its handoff: for each stage the last chunk passes, the median over rooms
    of milliseconds from its "kv_ready" (the latest over prefill ranks) to the stage (the latest over ranks and
    lanes, the critical path), in the order of those medians. Rooms without both "kv_ready" and "seen" are left
    out."""
    last = chunks - 1
    latest: dict[int, dict[str, float]] = {}
    for room, chunk, stage, at in marks:
        if chunk == last:
            stages = latest.setdefault(room, {})
            stages[stage] = max(stages.get(stage, at), at)
    offsets: dict[str, list[float]] = {}
    for stages in latest.values():
        if "kv_ready" in stages and "seen" in stages:
            for stage, at in stages.items():
                offsets.setdefault(stage, []).append((at - stages["kv_ready"]) * 1e3)
    medians = {stage: statistics.median(values) for stage, values in offsets.items()}
    return dict(sorted(medians.items(), key=lambda item: item[1]))
