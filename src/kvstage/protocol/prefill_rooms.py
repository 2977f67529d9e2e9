"""What a prefill rank remembers about each room: `WriterRoom`, its `Link`s (one per decode rank it writes to)
and each link's `WriterChunk`s.

Mutable records, changed only by prefill.py; their `state` fields change only through states.py's tables.
`kv_ready_problem` checks an engine's KVReady against its room (with the aux row's rules of aux.py);
`Link.ready_notice` builds a written chunk's ChunkReady (the last one with the room's aux row).
`Link.from_metadata` derives a link from a validated `Metadata` (metadata.py): the decode rank's chunk grid, the
head run this rank writes to it and, on the staged path, the staging plans of a full and of the last chunk.

Pure. Called by prefill.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstage.layout import Chunk, ChunkGrid, HeadTransfer, StagingPlan, pages_for, replica_turn
from kvstage.protocol import reasons
from kvstage.protocol.aux import kv_ready_aux_problem
from kvstage.protocol.config import PrefillConfig
from kvstage.protocol.events import KVReady
from kvstage.protocol.messages import DIRECT, ChunkReady, Metadata
from kvstage.protocol.plans import staging_plan, transfers_of_writer
from kvstage.protocol.states import PREFILL_CHUNK, ChunkState, ChunkTrigger, PrefillRoomState
from kvstage.ring import Allocation


@dataclass(slots=True, eq=False)
class WriterChunk:
    state: ChunkState = ChunkState.NONE
    region: Allocation | None = None


@dataclass(slots=True, eq=False)
class Link:
    """This rank's part of one room towards one decode rank."""

    peer_id: str
    meta: Metadata
    grid: ChunkGrid  # the decode rank's grid (Metadata.chunk_tokens)
    num_chunks: int
    transfer: HeadTransfer
    plan_full: StagingPlan | None  # staged only
    plan_last: StagingPlan | None
    chunks: dict[int, WriterChunk] = field(default_factory=dict)  # not yet acknowledged
    next_request: int = 0
    unwritten: int = 0  # requested but not yet written (R11 window)
    acked: int = 0

    def span(self, index: int) -> Chunk:
        """Chunk `index` (< num_chunks): its tokens of the room."""
        return self.grid.at(index, self.meta.num_tokens, self.meta.prefix_tokens)

    def holds_grants(self) -> bool:
        """Whether the decode peer ever granted this link anything (a chunk past REQUESTED, or acknowledged)."""
        return self.acked > 0 or any(not PREFILL_CHUNK.can(chunk, ChunkTrigger.GRANT) for chunk in self.chunks.values())

    @classmethod
    def from_metadata(cls, config: PrefillConfig, peer_id: str, m: Metadata) -> Link:
        """The link to the decode rank that sent `m`, which `metadata.metadata_problem` accepted."""
        grid = ChunkGrid(m.chunk_tokens, m.page_size)
        num_chunks = grid.num_chunks(m.num_tokens, m.prefix_tokens)
        layout, tp, rank = config.layout, config.tp_size, config.rank
        turn = replica_turn(m.room, tp)
        transfer = transfers_of_writer(layout.num_kv_heads, tp, m.decode_tp, rank, turn)[m.decode_rank]
        plan_full = plan_last = None
        if m.path != DIRECT:
            last_tokens = grid.chunk(num_chunks - 1, m.num_tokens, m.prefix_tokens).num_tokens
            plan_full = staging_plan(layout, tp, m.decode_tp, m.decode_rank, m.chunk_tokens, turn)
            plan_last = staging_plan(layout, tp, m.decode_tp, m.decode_rank, last_tokens, turn)
        return cls(peer_id, m, grid, num_chunks, transfer, plan_full, plan_last)

    def plan(self, index: int) -> StagingPlan:
        plan = self.plan_last if index == self.num_chunks - 1 else self.plan_full
        assert plan is not None
        return plan

    def ready_notice(self, r: WriterRoom, index: int, epoch: int) -> ChunkReady:
        """The ChunkReady of written chunk `index`: the room's last chunk carries its aux row (fixed once its KV was
        computed whole, which the last chunk's write waited for), so each retry of it carries the same bytes."""
        aux = r.aux if index == self.num_chunks - 1 else b""
        return ChunkReady(room=r.room, chunk=index, epoch=epoch, aux=aux)


@dataclass(slots=True, eq=False)
class WriterRoom:
    room: int
    num_tokens: int
    decode_tp: int  # 0 until the first decode rank's Metadata says it (AttachRoom without a decode TP)
    deadline: float
    targets: frozenset[int]  # decode ranks this rank writes to (known with decode_tp)
    links: dict[str, Link] = field(default_factory=dict)  # by decode peer id
    ranks: dict[int, str] = field(default_factory=dict)  # decode rank -> peer id of its link
    scheduled: int = 0  # tokens the engine is computing or has computed
    ready: int = 0  # tokens whose KV is computed
    pages: tuple[int, ...] = ()
    state: PrefillRoomState = PrefillRoomState.NONE
    reason: str = ""
    in_flight: int = 0  # writes issued and not completed
    links_done: int = 0
    owe_ack: dict[str, None] = field(default_factory=dict)  # decode peers that aborted: AbortAck when drained
    lost: dict[str, None] = field(default_factory=dict)  # decode peers gone: no Abort to them
    awaiting: dict[str, None] = field(default_factory=dict)  # decode peers our Abort waits on
    prompt: bytes = b""  # digest of the prompt the engine computes (empty: unchecked)
    aux: bytes = b""  # the engine's aux row, from the KVReady that completed the room (aux.py)
    claim_s: float = 0.0  # how long a computed room waits for its first decode rank (0: until its deadline)
    claim_by: float | None = None  # when it fails "unclaimed" if no decode rank took it (set once computed)

    def take_ready(self, event: KVReady) -> None:
        """Record an accepted KVReady: the newest pages, and the aux row of the one that first completes the room."""
        if event.end_tokens == self.num_tokens and self.ready < self.num_tokens:
            self.aux = event.aux
        if event.end_tokens >= self.ready:
            self.ready, self.pages = event.end_tokens, event.pages
        self.scheduled = max(self.scheduled, event.end_tokens)

    def await_claim(self, now: float) -> float | None:
        """The room's KV may have just been computed whole: when it fails "unclaimed" if no decode rank has taken it
        by then (an alarm to set), or None (no claim time, already set, taken, or not before its deadline)."""
        if not self.claim_s or self.claim_by is not None or self.ready < self.num_tokens or self.links:
            return None
        self.claim_by = now + self.claim_s
        return self.claim_by if self.claim_by < self.deadline else None

    def alarm(self, when: float) -> str | None:
        """Why the room fails at its alarm for `when`: its deadline, or its claim time with no decode rank linked;
        None for an alarm that no longer matters."""
        if self.deadline == when:
            return reasons.TIMEOUT
        if self.claim_by == when and not self.links:
            return reasons.UNCLAIMED
        return None


def kv_ready_problem(r: WriterRoom, event: KVReady, page_size: int, max_aux_bytes: int) -> str | None:
    """Why `event` is an invalid engine call for the active room `r` (None: it is fine): tokens out of range, too
    few pages, or an aux row it may not carry (aux.py)."""
    end, need = event.end_tokens, pages_for(event.end_tokens, page_size)
    if not 0 < end <= r.num_tokens or len(event.pages) < need:
        return (
            f"room {r.room}: KVReady(end_tokens={end}) needs 0 < end <= {r.num_tokens} and >= {need} pages, "
            f"got {len(event.pages)}"
        )
    return kv_ready_aux_problem(event, r.num_tokens, r.ready, r.aux, max_aux_bytes)


def writer_targets(config: PrefillConfig, room: int, decode_tp: int) -> frozenset[int]:
    """The decode ranks the rank of `config` writes `room` to for a decode instance of TP `decode_tp` (0: not known
    yet: none)."""
    if not decode_tp:
        return frozenset()
    turn = replica_turn(room, config.tp_size)
    return frozenset(transfers_of_writer(config.layout.num_kv_heads, config.tp_size, decode_tp, config.rank, turn))


def write_failure(reason: str, peer_gone: bool) -> str:
    """The room's reason for a failed write: the peer is gone ("peer dead", as the liveness check would say), the
    write was refused for a lapsed lease ("lease expired", R13), or else "transfer failed"."""
    if peer_gone:
        return reasons.PEER_DEAD
    return reasons.LEASE_EXPIRED if reason == reasons.LEASE_EXPIRED else reasons.TRANSFER_FAILED
