"""Chunk stamps: when each chunk of a room passed each stage of one agent, for `kvstage bench`'s breakdown.

Owns `ChunkTrace`, a bounded record of `Mark`s (room, chunk, stage, the peer at the other end where the stage
has one, `time.monotonic()`), off unless the agent is
built with `AgentConfig.trace_chunks > 0`. CLOCK_MONOTONIC is shared by every process of a host, so the stamps of
a prefill and a decode rank on one host line up and give the control hops between them too.

Stages, in a chunk's order (a `*_out` stamp is the reactor handing a message to the control channel, a `*_in`
stamp the reactor taking it up; `STAGES` lists them):

    prefill  request_out   a StagingRequest sent (the engine scheduled the chunk's tokens)
    decode   request_in, grant_out
    prefill  grant_in      the Grant arrived
             issued        its write was issued (granted and computed)
             gather_begin, gather_end   the gather on the reactor (on a GPU: queued, not landed)
             gather_seen   the reactor took up the gather's end
             posted        the write was handed to the transport
             written       the reactor saw the write complete
             ready_out     its ChunkReady sent
    decode   ready_in      a writer's ChunkReady arrived (the last one of the chunk starts the scatter)
             scatter_issued, scatter_begin, scatter_end   the scatter on the reactor
             landed        the reactor saw the scatter land; the chunk's ring space is freed

Invariants: at most `capacity` marks are kept (the oldest go first); `mark` is safe from any thread (a deque append)
and costs one attribute test when tracing is off. Called by runtime/agent.py, decode.py and prefill.py; read by
`kvstage bench` (bench/stages.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

#: Every stage, in the order a chunk passes them.
STAGES: tuple[str, ...] = (
    "request_out",
    "request_in",
    "grant_out",
    "grant_in",
    "issued",
    "gather_begin",
    "gather_end",
    "gather_seen",
    "posted",
    "written",
    "ready_out",
    "ready_in",
    "scatter_issued",
    "scatter_begin",
    "scatter_end",
    "landed",
)

#: The message bodies whose sends and arrivals are stamped, by their wire tag: the stage names' stem.
MESSAGE_STAGES: dict[str, str] = {"stage_req": "request", "grant": "grant", "ready": "ready"}


@dataclass(frozen=True, slots=True)
class Mark:
    """Chunk `chunk` of room `room` passed `stage` at `at` (`time.monotonic()`); `peer`: the other end (the
    message's sender or addressee, the write's decode peer), "" for a decode scatter (all writers at once)."""

    room: int
    chunk: int
    stage: str
    at: float
    peer: str = ""


class ChunkTrace:
    """The last `capacity` chunk marks of one agent; `capacity` 0 records nothing."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"trace capacity must be >= 0, got {capacity}")
        self._marks: deque[Mark] | None = deque(maxlen=capacity) if capacity else None

    @property
    def enabled(self) -> bool:
        return self._marks is not None

    def mark(self, room: int, chunk: int, stage: str, peer: str = "") -> None:
        if self._marks is not None:
            self._marks.append(Mark(room, chunk, stage, time.monotonic(), peer))

    def message(self, body: object, direction: str, peer: str) -> None:
        """Stamp a control message of a chunk ("out": sent to `peer`, "in": from `peer`, taken up), if it is one
        of MESSAGE_STAGES."""
        if self._marks is None:
            return
        tag = getattr(type(body), "__struct_config__", None)
        stem = MESSAGE_STAGES.get(getattr(tag, "tag", None) or "")
        if stem is not None:
            self.mark(body.room, body.chunk, f"{stem}_{direction}", peer)  # type: ignore[attr-defined]

    def drain(self) -> list[Mark]:
        """The marks recorded so far, oldest first; they are forgotten."""
        if self._marks is None:
            return []
        out: list[Mark] = []
        while self._marks:
            out.append(self._marks.popleft())
        return out
