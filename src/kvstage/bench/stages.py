"""A staged chunk's time, stage by stage: `kvstage bench`'s breakdown of the agents' chunk stamps.

Owns `chunk_breakdown`, which turns the `runtime/trace.py` marks of every rank of one round into the median time
of each segment of a chunk's path, and the chunk's latency and period:

    grant hop       decode sends a Grant -> prefill's agent takes it up          (control round trip, one way)
    wait compute    the Grant taken up -> the write issued (the chunk's KV computed: R11)
    gather queue    issued -> the reactor starts the gather
    gather          the gather on the reactor (on a GPU: queueing it)
    gather pickup   the gather's end -> prefill's reactor takes it up
    write window    taken up -> posted (waits for the peer's write window and the lease)
    write           posted -> prefill's agent sees it complete
    ready hop       complete -> decode's agent takes up the ChunkReady            (control, one way)
    scatter start   the chunk's last ChunkReady taken up -> the scatter issued
    scatter queue   issued -> the reactor starts it
    scatter         the scatter on the reactor (on a GPU: queueing it)
    land            the scatter's end -> decode's agent sees it landed and frees the ring space
    latency         the chunk's first write issued (granted and computed) -> landed
    period          between successive chunks of a room landing on a decode rank: the time each chunk costs

A prefill-side segment is measured per (room, chunk, prefill rank, decode rank) lane, a scatter per (room, chunk,
decode rank); a mark that repeats on a lane (a retried message) counts from its first time. Marks come from the
processes of one host, whose `time.monotonic()` clocks agree. Pure: no I/O. Called by bench/runner.py.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable

#: One rank's mark: (that rank's peer id, room, chunk, stage, time, the peer at the other end or "").
RankMark = tuple[str, int, int, str, float, str]

#: Lane segments: (name, from stage, to stage), measured per (room, chunk, prefill peer, decode peer).
LANE_SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("grant hop", "grant_out", "grant_in"),
    ("wait compute", "grant_in", "issued"),
    ("gather queue", "issued", "gather_begin"),
    ("gather", "gather_begin", "gather_end"),
    ("gather pickup", "gather_end", "gather_seen"),
    ("write window", "gather_seen", "posted"),
    ("write", "posted", "written"),
    ("ready hop", "written", "ready_in"),
)
#: Scatter segments, per (room, chunk, decode peer); "ready_in" there is the chunk's last writer's.
SCATTER_SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("scatter start", "ready_in", "scatter_issued"),
    ("scatter queue", "scatter_issued", "scatter_begin"),
    ("scatter", "scatter_begin", "scatter_end"),
    ("land", "scatter_end", "landed"),
)
#: Stages a decode rank stamps per message from one prefill peer (the rest of its stamps are per chunk).
_DECODE_LANE_STAGES = frozenset({"request_in", "grant_out", "ready_in"})

_Lane = tuple[int, int, str, str]  # room, chunk, prefill peer, decode peer
_Chunk = tuple[int, int, str]  # room, chunk, decode peer


def chunk_breakdown(marks: Iterable[RankMark], decode_peers: frozenset[str]) -> dict[str, float]:
    """Median seconds of each segment over the chunks of one round (only segments seen), with "latency",
    "period" and "chunks" (how many chunk scatters landed). `decode_peers`: the peer ids of the decode ranks."""
    lanes: dict[_Lane, dict[str, float]] = defaultdict(dict)
    chunks: dict[_Chunk, dict[str, float]] = defaultdict(dict)
    for local, room, chunk, stage, at, peer in marks:
        if local in decode_peers and stage not in _DECODE_LANE_STAGES:
            chunks[(room, chunk, local)].setdefault(stage, at)
            continue
        lane = (room, chunk, peer, local) if local in decode_peers else (room, chunk, local, peer)
        lanes[lane].setdefault(stage, at)
    for (room, chunk, _, decode), stamps in lanes.items():
        if "ready_in" in stamps:
            held = chunks[(room, chunk, decode)]
            held["ready_in"] = max(held.get("ready_in", stamps["ready_in"]), stamps["ready_in"])
        if "issued" in stamps:
            held = chunks[(room, chunk, decode)]
            held["issued"] = min(held.get("issued", stamps["issued"]), stamps["issued"])
    samples: dict[str, list[float]] = defaultdict(list)
    _segments(lanes.values(), LANE_SEGMENTS, samples)
    _segments(chunks.values(), (*SCATTER_SEGMENTS, ("latency", "issued", "landed")), samples)
    samples["period"] = _periods(chunks)
    out = {name: statistics.median(values) for name, values in samples.items() if values}
    out["chunks"] = float(sum(1 for stamps in chunks.values() if "landed" in stamps))
    return out


def _segments(
    stamped: Iterable[dict[str, float]], segments: tuple[tuple[str, str, str], ...], into: dict[str, list[float]]
) -> None:
    for stamps in stamped:
        for name, begin, end in segments:
            if begin in stamps and end in stamps:
                into[name].append(stamps[end] - stamps[begin])


def _periods(chunks: dict[_Chunk, dict[str, float]]) -> list[float]:
    """Gaps between successive landings of one room's chunks on one decode rank."""
    landed: dict[tuple[int, str], list[float]] = defaultdict(list)
    for (room, _, decode), stamps in chunks.items():
        if "landed" in stamps:
            landed[(room, decode)].append(stamps["landed"])
    gaps: list[float] = []
    for times in landed.values():
        times.sort()
        gaps += [b - a for a, b in itertools.pairwise(times)]
    return gaps
