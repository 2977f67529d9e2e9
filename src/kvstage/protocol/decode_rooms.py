"""What a decode rank remembers about each room: `ReaderRoom` and its `ReaderChunk`s, and `LiveGrants`, the ring
regions granted and not yet freed.

Mutable records, changed only by decode.py; a room's `state` changes only through states.py's `DECODE_ROOM`.
`LiveGrants` maps each live region (by its allocation epoch) to the room and chunk it serves, so it holds no more
entries than the ring has live allocations, and answers R9's question: may a writer hold a chunk parked for want of
a higher watermark?

Pure. Called by decode.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstage.layout import StagingPlan
from kvstage.protocol.base import Peer
from kvstage.protocol.messages import Path
from kvstage.protocol.states import DecodeRoomState
from kvstage.ring import Allocation, Watermark, region_ready


@dataclass(slots=True, eq=False)
class ReaderChunk:
    """One chunk of a room on this decode rank: its ring region (staged), which writers' ChunkReady arrived."""

    region: Allocation | None = None  # staged: the chunk's ring region until freed
    arrived: int = 0  # bitmask over the room's writer slots
    done: bool = False


@dataclass(slots=True, eq=False)
class ReaderRoom:
    """One room on this decode rank: what ExpectRoom said, its writers, its chunks, and who may still write."""

    room: int
    path: Path
    prefill_tp: int
    writers: dict[str, int]  # writer peer id -> slot (bit index)
    num_tokens: int
    prefix_tokens: int
    num_chunks: int
    pages: tuple[int, ...]
    deadline: float
    epoch: int  # direct path: the epoch every grant and ChunkReady of this room carries
    plan_full: StagingPlan
    plan_last: StagingPlan
    state: DecodeRoomState = DecodeRoomState.NONE
    reason: str | None = None  # why it failed
    chunks: dict[int, ReaderChunk] = field(default_factory=dict)
    done_chunks: int = 0
    scatters_in_flight: int = 0
    granted: dict[str, None] = field(default_factory=dict)  # writers ever sent a grant (they may write)
    acked: dict[str, None] = field(default_factory=dict)  # writers that know the room ended (or are gone)
    safe: dict[str, None] = field(default_factory=dict)  # writers none of whose writes can still land
    safe_at: dict[str, float] = field(default_factory=dict)  # restarted writers: safe from then on (R13)
    bound: dict[str, tuple[int, int]] = field(default_factory=dict)  # writer -> incarnation that served the room
    bystanders: dict[str, None] = field(default_factory=dict)  # rank 0: prefill ranks that write to no decode rank
    pages_returned: bool = False
    regions_freed: bool = False
    prompt: bytes = b""  # digest of the prompt's tokens, sent in Metadata (empty: unchecked)
    aux: bytes = b""  # the aux row the last chunk's writers sent (aux.py), reported with the room's success

    @property
    def all_writers(self) -> int:
        return (1 << len(self.writers)) - 1

    def plan(self, chunk: int) -> StagingPlan:
        return self.plan_last if chunk == self.num_chunks - 1 else self.plan_full

    def unacked(self) -> list[str]:
        return [w for w in self.writers if w not in self.acked]

    def unsafe(self) -> bool:
        """True while a write of a granted writer may still land (R6, R13)."""
        return any(w not in self.safe for w in self.granted)

    def vouches(self, peer: Peer) -> bool:
        """Whether `peer`'s word covers the room's writes: only the incarnation that served the room can say
        that none of them can land any more (a restarted writer's new process knows nothing of the old one's)."""
        return self.bound.get(peer.peer_id, peer.incarnation) == peer.incarnation


class LiveGrants:
    """Ring regions granted and not yet freed, by allocation epoch: the room and chunk each one serves."""

    def __init__(self) -> None:
        self._by_epoch: dict[int, tuple[ReaderRoom, ReaderChunk]] = {}

    def add(self, r: ReaderRoom, chunk: ReaderChunk) -> None:
        assert chunk.region is not None
        self._by_epoch[chunk.region.epoch] = (r, chunk)

    def drop(self, region: Allocation) -> None:
        del self._by_epoch[region.epoch]

    def waiting(self, known: Callable[[str], Watermark]) -> set[str]:
        """R9: the writers that may hold a chunk parked: each has a region granted to it that it has not written
        yet and that is not ready under `known(writer)`, the watermark on the last frame sent to it. One pass over
        the live regions, however many peers there are."""
        found: set[str] = set()
        for r, chunk in self._by_epoch.values():
            region = chunk.region
            if region is None:
                continue
            for writer, slot in r.writers.items():
                unwritten = writer in r.granted and not chunk.arrived >> slot & 1
                if unwritten and writer not in found and not region_ready(region, known(writer)):
                    found.add(writer)
        return found
