"""DecodeEndpoint: the sans-I/O state machine of one decode rank, owner of its StagingRing.

Owns the decode side of every room this rank receives: registration (before announcing, R2), grants from the
ring (one allocation per chunk, shared by the chunk's writers), arrival counting per chunk and writer, scatter,
completion by arrival (R5), and release on every terminal path (R1) with quarantine until no write can land
(R6). It serves many prefill peers and many rooms at once; rooms may mix TP pairs and paths (R12).

Room states: `states.DECODE_ROOM` is the table (docs/protocol.md shows it). Every guard on a room's state asks
`DECODE_ROOM.can`, and every change goes through `DECODE_ROOM.move`, which refuses an edge not in the table. A
room is forgotten, and remembered in a bounded closed-room record, after its last state.

Inbound checks (R10, B1): a message for an unknown room allocates nothing and is answered (GrantRefused
"unknown room"/"room closed", ChunkAck, AbortAck); the sender must be a writer of the room; chunk indices
must be < the room's chunk count; ChunkReady epochs must match the grant (R7, else dropped and counted); an aux
row on a ChunkReady that is not of the room's last chunk, over `Limits.max_aux_bytes`, or unlike the one another
writer sent fails the room "protocol violation" (aux.py); the last chunk's aux row is reported in RoomSucceeded.

Invariants kept: a chunk's ring region is freed exactly once, after its scatter completed or after the room
was fenced and no write of a granted writer can land any more (R6, R13: that writer's own Abort or AbortAck
from the incarnation that served the room; declared dead; or restarted, and `Timing.quarantine_s` has passed
since its old incarnation was last heard); KV pages are returned exactly once, on failure only, after the
scatter fence (staged) or once the writers are safe (direct); the watermark rides on every envelope, and a moved
one is sent at once to every writer that may hold a chunk parked for want of it (R9, decode_rooms.LiveGrants).
Room records live in decode_rooms.py. Called by runtime/ and sim/.
"""

from __future__ import annotations

from kvstage.errors import ConfigError, InvalidRequest, StagingOversized
from kvstage.layout import ChunkGrid, pages_for, replica_turn
from kvstage.protocol import reasons
from kvstage.protocol.actions import FenceScatter, FreePages, RoomFailed, RoomSucceeded, Scatter
from kvstage.protocol.aux import chunk_ready_aux_problem
from kvstage.protocol.base import EndpointCore, Peer
from kvstage.protocol.codec import Codec
from kvstage.protocol.config import DecodeConfig
from kvstage.protocol.decode_rooms import LiveGrants, ReaderChunk, ReaderRoom
from kvstage.protocol.events import AbortRoom, ExpectRoom
from kvstage.protocol.messages import (
    DIRECT,
    MAX_CHUNKS,
    MAX_DIGEST_LEN,
    Abort,
    AbortAck,
    ChunkAck,
    ChunkReady,
    Grant,
    GrantRefused,
    Heartbeat,
    Metadata,
    MetadataAck,
    StagingRequest,
    WireWatermark,
)
from kvstage.protocol.plans import choose_path, idle_writers, staging_plan
from kvstage.protocol.states import DECODE_ROOM, DecodeRoomState, DecodeTrigger
from kvstage.ring import Allocation, StagingRing, Watermark

_T = DecodeTrigger
_ZERO = Watermark(0, 0)  # what a peer knows of the watermark before any frame reached it


class DecodeEndpoint(EndpointCore):
    """One decode rank. `handle(event, now) -> list[Action]`; see kvstage.protocol for the API."""

    ROLE = "decode"

    def __init__(
        self, config: DecodeConfig, session: int, *, ring: StagingRing | None = None, codec: Codec | None = None
    ) -> None:
        super().__init__(config.peer_id, session, config.timing, config.limits, codec)
        self.config = config
        self._ring = ring if ring is not None else StagingRing(config.ring_bytes, config.ring_alignment)
        self._grid = ChunkGrid(config.chunk_tokens, config.layout.page_size)
        self._rooms: dict[int, ReaderRoom] = {}
        self._grants = LiveGrants()  # ring regions granted and not yet freed (R9)
        self._tokens: dict[int, tuple[int, int]] = {}  # token -> (room, chunk); chunk -1 is the room's fence
        self._room_epoch = 0
        self._wm_sent = self._ring.watermark
        self._wm_wire = WireWatermark(self._wm_sent.round, self._wm_sent.tail)
        self._event_handlers[ExpectRoom] = self._on_expect
        self._event_handlers[AbortRoom] = self._on_abort_room
        self._body_handlers.update(
            {
                MetadataAck: self._on_metadata_ack,
                StagingRequest: self._on_staging_request,
                ChunkReady: self._on_chunk_ready,
                Abort: self._on_abort,
                AbortAck: self._on_abort_ack,
            }
        )

    # ---- introspection ----------------------------------------------------------------------------------------
    @property
    def ring(self) -> StagingRing:
        """The staging ring (read it only)."""
        return self._ring

    def open_rooms(self) -> frozenset[int]:
        return frozenset(self._rooms)

    def room_state(self, room: int) -> DecodeRoomState | None:
        r = self._rooms.get(room)
        return None if r is None else r.state

    def is_quiescent(self) -> bool:
        return not self._rooms and not self._tokens and not len(self._retrier) and self._ring.num_live == 0

    # ---- engine events ----------------------------------------------------------------------------------------
    def _on_expect(self, event: ExpectRoom) -> None:
        """R2: register the room first, then announce it to each writer."""
        r = self._register(event)
        self.stats.rooms_opened += 1
        for peer_id in r.writers:
            self._ensure_peer(peer_id).rooms[r.room] = None
        self._deadlines.push(r.deadline, r.room)
        largest = r.plan_full if r.num_chunks > 1 else r.plan_last
        if r.path != DIRECT and largest.total_bytes > self._ring.capacity_bytes:
            self._fail(r, reasons.STAGING_OVERSIZED)  # R3: at once, no fallback to another path
            return
        for peer_id, slot in r.writers.items():
            self._request("meta", peer_id, self._metadata(r), slot)
        if self.config.rank == 0:  # the prefill ranks no decode rank hears from learn decode's TP from rank 0
            turn = replica_turn(r.room, r.prefill_tp)
            for rank in idle_writers(self.config.layout.num_kv_heads, r.prefill_tp, self.config.tp_size, turn):
                r.bystanders[event.prefill_peers[rank]] = None
                self._request("meta", event.prefill_peers[rank], self._metadata(r, bystander=True))

    def _metadata(self, r: ReaderRoom, bystander: bool = False) -> Metadata:
        return Metadata(
            room=r.room,
            decode_rank=self.config.rank,
            decode_tp=self.config.tp_size,
            prefill_tp=r.prefill_tp,
            num_tokens=r.num_tokens,
            prefix_tokens=r.prefix_tokens,
            chunk_tokens=self.config.chunk_tokens,
            page_size=self.config.layout.page_size,
            path=r.path,
            epoch=r.epoch,
            ttl_s=max(0.0, r.deadline - self._now),
            pages=r.pages if r.path == DIRECT and not bystander else (),
            ring_bytes=0 if r.path == DIRECT else self._ring.capacity_bytes,
            prompt=r.prompt,
            bystander=bystander,
        )

    def _register(self, event: ExpectRoom) -> ReaderRoom:
        cfg = self.config
        page_size = cfg.layout.page_size
        if event.room in self._rooms or event.room in self._closed:
            raise InvalidRequest(f"room {event.room} is already registered on {cfg.peer_id}; room ids are unique")
        prefill_tp = len(event.prefill_peers)
        if prefill_tp < 1 or len(set(event.prefill_peers)) != prefill_tp:
            raise InvalidRequest(f"room {event.room}: prefill_peers must be distinct peer ids, one per prefill rank")
        if not 0 <= event.prefix_tokens < event.num_tokens or event.prefix_tokens % page_size:
            raise InvalidRequest(
                f"room {event.room}: prefix_tokens={event.prefix_tokens} must be a multiple of page_size="
                f"{page_size} below num_tokens={event.num_tokens}"
            )
        if len(event.prompt) > MAX_DIGEST_LEN:
            raise InvalidRequest(f"room {event.room}: a prompt digest of at most {MAX_DIGEST_LEN} bytes, got "
                                 f"{len(event.prompt)}")  # fmt: skip
        if len(event.pages) != pages_for(event.num_tokens, page_size):
            raise InvalidRequest(
                f"room {event.room}: {len(event.pages)} pages given, {pages_for(event.num_tokens, page_size)} needed "
                f"for {event.num_tokens} tokens at page_size={page_size}"
            )
        num_chunks = self._grid.num_chunks(event.num_tokens, event.prefix_tokens)
        if num_chunks > MAX_CHUNKS:
            raise InvalidRequest(f"room {event.room}: {num_chunks} chunks exceed the protocol bound {MAX_CHUNKS}")
        try:
            turn = replica_turn(event.room, prefill_tp)
            plan_full = staging_plan(cfg.layout, prefill_tp, cfg.tp_size, cfg.rank, cfg.chunk_tokens, turn)
            last_tokens = self._grid.chunk(num_chunks - 1, event.num_tokens, event.prefix_tokens).num_tokens
            plan_last = staging_plan(cfg.layout, prefill_tp, cfg.tp_size, cfg.rank, last_tokens, turn)
        except ConfigError as exc:
            raise InvalidRequest(f"room {event.room}: prefill TP {prefill_tp} cannot feed this rank: {exc}") from exc
        self._room_epoch += 1
        r = ReaderRoom(
            room=event.room,
            path=choose_path(cfg.attention, prefill_tp, cfg.tp_size, cfg.staged_only or not event.direct),
            prefill_tp=prefill_tp,
            writers={event.prefill_peers[rank]: slot for slot, rank in enumerate(plan_full.writers)},
            num_tokens=event.num_tokens,
            prefix_tokens=event.prefix_tokens,
            num_chunks=num_chunks,
            pages=event.pages,
            deadline=event.deadline,
            epoch=self._room_epoch,
            plan_full=plan_full,
            plan_last=plan_last,
            prompt=event.prompt,
        )
        DECODE_ROOM.move(r, _T.EXPECT, r.room)
        self._rooms[r.room] = r
        return r

    def _on_abort_room(self, event: AbortRoom) -> None:
        r = self._rooms.get(event.room)
        if r is None:
            if event.room not in self._closed:
                raise InvalidRequest(f"room {event.room} is not known on {self.peer_id}")
            return
        self._fail(r, reasons.ABORTED_BY_DECODE)

    # ---- inbound messages -------------------------------------------------------------------------------------
    def _writer_room(self, peer: Peer, room: int, what: str) -> ReaderRoom | None:
        """The room if `peer` is one of its writers (binding the room to the peer's incarnation); otherwise None
        (rejected and counted)."""
        r = self._rooms.get(room)
        if r is None:
            return None
        if peer.peer_id not in r.writers:
            self.stats.reject(f"{what} from a non-writer")
            return None
        self._bind(r, peer)
        return r

    @staticmethod
    def _bind(r: ReaderRoom, peer: Peer) -> None:
        """The first incarnation of a writer that speaks about a room serves it; a restart fails only bound rooms."""
        if peer.peer_id not in r.bound and peer.incarnation is not None:
            r.bound[peer.peer_id] = peer.incarnation

    def _on_metadata_ack(self, peer: Peer, body: MetadataAck) -> None:
        if self._bystander_answered(peer, body.room):
            return
        r = self._writer_room(peer, body.room, "MetadataAck")
        if r is not None and not self._answered("meta", peer.peer_id, r.room, r.writers[peer.peer_id]):
            self.stats.duplicates += 1

    def _refuse(self, peer: Peer, body: StagingRequest, reason: str) -> None:
        self.stats.refusals_sent += 1
        self._send(peer.peer_id, GrantRefused(room=body.room, chunk=body.chunk, reason=reason))

    def _on_staging_request(self, peer: Peer, body: StagingRequest) -> None:
        r = self._rooms.get(body.room)
        if r is None:
            closed = body.room in self._closed
            if not closed:
                self.stats.reject("unknown room")
            self._refuse(peer, body, reasons.ROOM_CLOSED if closed else reasons.UNKNOWN_ROOM)
            return
        slot = r.writers.get(peer.peer_id)
        if slot is None or body.chunk >= r.num_chunks:
            self.stats.reject("staging request from a non-writer" if slot is None else "chunk index out of range")
            self._refuse(peer, body, reasons.PROTOCOL_VIOLATION)
            return
        if not DECODE_ROOM.can(r, _T.GRANT):
            self._refuse(peer, body, reasons.ROOM_CLOSED)
            return
        self._bind(r, peer)
        self._answered("meta", peer.peer_id, r.room, slot)  # a request proves the metadata arrived
        chunk = r.chunks.get(body.chunk)
        if chunk is None:
            chunk = r.chunks[body.chunk] = ReaderChunk()
        if chunk.done:
            self.stats.duplicates += 1  # its writers all wrote and were acked; nothing is owed
            return
        if r.path == DIRECT:
            grant = Grant(room=r.room, chunk=body.chunk, round=0, offset=0, end=0, epoch=r.epoch)
        else:
            if chunk.region is None:
                chunk.region = self._allocate(r, body.chunk)
                if chunk.region is None:
                    return
                self._grants.add(r, chunk)
            region = chunk.region
            grant = Grant(
                room=r.room,
                chunk=body.chunk,
                round=region.round,
                offset=region.offset,
                end=region.end,
                epoch=region.epoch,
            )
        r.granted[peer.peer_id] = None
        self._send(peer.peer_id, grant)

    def _allocate(self, r: ReaderRoom, chunk: int) -> Allocation | None:
        try:
            return self._ring.allocate(r.plan(chunk).total_bytes)
        except StagingOversized:
            self._fail(r, reasons.STAGING_OVERSIZED)
            return None

    def _on_chunk_ready(self, peer: Peer, body: ChunkReady) -> None:
        r = self._rooms.get(body.room)
        if r is None:
            if body.room not in self._closed:
                self.stats.reject("unknown room")
            else:
                self.stats.duplicates += 1
            self._send(peer.peer_id, ChunkAck(room=body.room, chunk=body.chunk))  # stop its retries; no state
            return
        slot = r.writers.get(peer.peer_id)
        if slot is None or body.chunk >= r.num_chunks:
            self.stats.reject("chunk ready from a non-writer" if slot is None else "chunk index out of range")
            return
        if not DECODE_ROOM.can(r, _T.CHUNK_READY):
            self.stats.stale_dropped += 1  # our Abort to this writer is being retried
            return
        self._bind(r, peer)
        chunk = r.chunks.get(body.chunk)
        expected = r.epoch if r.path == DIRECT else (chunk.region.epoch if chunk and chunk.region else None)
        bit = 1 << slot
        if chunk is None or (not chunk.done and body.epoch != expected):
            self.stats.stale_dropped += 1  # R7: never granted, or another grant's epoch
            return
        if (problem := chunk_ready_aux_problem(body, r.num_chunks, r.aux, self.limits.max_aux_bytes)) is not None:
            self.stats.reject(problem)
            self._fail(r, reasons.PROTOCOL_VIOLATION)
            return
        r.aux = r.aux or body.aux
        self._send(peer.peer_id, ChunkAck(room=r.room, chunk=body.chunk))
        if chunk.arrived & bit:
            self.stats.duplicates += 1
            return
        chunk.arrived |= bit
        if chunk.arrived == r.all_writers:
            self._chunk_complete(r, body.chunk, chunk)

    def _chunk_complete(self, r: ReaderRoom, index: int, chunk: ReaderChunk) -> None:
        """Every writer of `chunk` has landed: scatter it (staged) or count it done (direct)."""
        if r.path == DIRECT:
            self._chunk_done(r, chunk)
            return
        assert chunk.region is not None
        token = self._new_token()
        self._tokens[token] = (r.room, index)
        r.scatters_in_flight += 1
        span = self._grid.at(index, r.num_tokens, r.prefix_tokens)
        self._out.append(Scatter(token, r.room, index, chunk.region, r.plan(index), span.start, span.num_tokens))

    def _chunk_done(self, r: ReaderRoom, chunk: ReaderChunk) -> None:
        chunk.done = True
        r.done_chunks += 1
        if r.done_chunks == r.num_chunks:
            DECODE_ROOM.move(r, _T.SUCCEED, r.room)
            self.stats.rooms_succeeded += 1
            self._out.append(RoomSucceeded(r.room, r.aux))
            self._forget(r, None)

    def _bystander_answered(self, peer: Peer, room: int) -> bool:
        """A bystander answered its notice (`MetadataAck`, or `Abort`: its room had ended): stop re-sending it."""
        r = self._rooms.get(room)
        if r is None or peer.peer_id not in r.bystanders:
            return False
        del r.bystanders[peer.peer_id]
        self._answered("meta", peer.peer_id, room)
        return True

    def _on_abort(self, peer: Peer, body: Abort) -> None:
        """A writer failed the room; its Abort also says that none of its writes can still land."""
        if self._bystander_answered(peer, body.room):  # a rank that writes nothing: its room ended, this one goes on
            self._send(peer.peer_id, AbortAck(room=body.room))
            return
        r = self._writer_room(peer, body.room, "Abort")
        self._send(peer.peer_id, AbortAck(room=body.room))
        if r is not None:
            self._acknowledge(r, peer.peer_id, safe=r.vouches(peer))
            self._fail(r, reasons.ABORTED_BY_PREFILL)
            self._settle(r)

    def _on_abort_ack(self, peer: Peer, body: AbortAck) -> None:
        r = self._writer_room(peer, body.room, "AbortAck")
        if r is None or not DECODE_ROOM.can(r, _T.ABORT_ACK):
            self.stats.duplicates += 1
            return
        self._acknowledge(r, peer.peer_id, safe=r.vouches(peer))
        self._settle(r)

    # ---- completions, timers, peers ---------------------------------------------------------------------------
    def _on_token(self, token: int, ok: bool, reason: str, peer_gone: bool) -> None:
        entry = self._tokens.pop(token, None)
        if entry is None:
            self.stats.reject("unknown completion token")
            return
        room, index = entry
        r = self._rooms.get(room)
        if r is None:
            return  # a scatter completing after its room's fence completed and the room was released
        if index < 0:
            DECODE_ROOM.move(r, _T.FENCED, r.room)
            self._return_pages_after_fence(r)
            self._settle(r)
            return
        chunk = r.chunks[index]
        r.scatters_in_flight -= 1
        if not DECODE_ROOM.can(r, _T.SCATTERED):
            return  # the fence covers it; its region is freed with the room's
        if not ok:
            self._fail(r, reasons.SCATTER_FAILED)
            return
        self._free_region(chunk)
        self._chunk_done(r, chunk)

    def _room_deadline(self, room: int) -> float:
        return self._rooms[room].deadline

    def _deadline_live(self, when: float, room: int) -> bool:
        r = self._rooms.get(room)
        if r is None:
            return False
        return (DECODE_ROOM.can(r, _T.FAIL) and r.deadline == when) or when in r.safe_at.values()

    def _on_deadline(self, when: float, room: int) -> None:
        r = self._rooms.get(room)
        if r is None:
            return
        if DECODE_ROOM.can(r, _T.FAIL) and r.deadline == when:
            self._fail(r, reasons.TIMEOUT)
        due = [writer for writer, at in r.safe_at.items() if at <= self._now]
        for writer in due:
            del r.safe_at[writer]
            r.safe[writer] = None
        if due:
            self._settle(r)

    def _fail_by_id(self, room: int, peer_id: str, reason: str) -> None:
        r = self._rooms.get(room)
        if r is not None and peer_id in r.writers:
            self._fail(r, reason)

    def _peer_lost(self, peer: Peer, room: int, reason: str) -> None:
        """R6/R13: a dead writer was silent for dead_after_s >= quarantine_s, so none of its writes can land; a
        restarted one's old process may still have writes in flight until last_heard + quarantine_s; a writer that
        fenced us vouches for its writes only by its own Abort or AbortAck."""
        r = self._rooms[room]
        if reason != reasons.PEER_DEAD and peer.peer_id not in r.bound:
            return  # restarted or re-epoched, and no incarnation served this room yet: its retried metadata will
        if reason == reasons.PEER_DEAD:
            self._acknowledge(r, peer.peer_id, safe=True)
        elif reason == reasons.PEER_RESTARTED:
            self._acknowledge(r, peer.peer_id, safe=False)
            self._safe_later(r, peer.peer_id, peer.last_heard + self.timing.quarantine_s)
        self._fail(r, reason)
        self._settle(r)

    def _safe_later(self, r: ReaderRoom, writer: str, at: float) -> None:
        if writer in r.safe or writer not in r.granted:
            return
        if at <= self._now:
            r.safe[writer] = None
            return
        self.stats.quarantine_timers += 1
        r.safe_at[writer] = at
        self._deadlines.push(at, r.room)

    def _watermark(self) -> WireWatermark:
        return self._wm_wire

    def _on_new_incarnation(self, peer: Peer) -> None:
        self._send(peer.peer_id, Heartbeat())  # R4: a new or restarted session gets the watermark at once

    def _after_event(self) -> None:
        """R4/R9: whenever the watermark moved, tell every peer that may have a chunk parked for want of it (any
        other peer learns it from its next frame)."""
        watermark = self._ring.watermark
        if watermark != self._wm_sent:
            self._wm_sent, self._wm_wire = watermark, WireWatermark(watermark.round, watermark.tail)
            waiting = self._grants.waiting(self._told)
            for peer in self._peers.values():  # in the peers' order, not the set's: the core stays deterministic
                if peer.rooms and peer.peer_id in waiting:
                    self._send(peer.peer_id, Heartbeat())

    def _told(self, peer_id: str) -> Watermark:
        """The watermark on the last frame sent to `peer_id` (none yet: the lowest)."""
        peer = self._peers.get(peer_id)
        told = None if peer is None else peer.told
        return _ZERO if told is None else Watermark(told.round, told.tail)

    def _free_region(self, chunk: ReaderChunk) -> None:
        assert chunk.region is not None
        self._grants.drop(chunk.region)
        self._ring.free(chunk.region)
        chunk.region = None

    # ---- release (R1, R6) -------------------------------------------------------------------------------------
    def _fail(self, r: ReaderRoom, reason: str) -> None:
        """Fail an ACTIVE room (idempotent): report, tell the writers, fence scatters, then release."""
        if not DECODE_ROOM.can(r, _T.FAIL):
            return
        r.reason = reason
        self.stats.failures[reason] += 1
        self._out.append(RoomFailed(r.room, reason))
        self._retrier.stop_room(r.room)
        for peer_id in r.unacked():
            self._request("abort", peer_id, Abort(room=r.room, reason=reason))
        if r.scatters_in_flight:
            DECODE_ROOM.move(r, _T.FAIL_SCATTERING, r.room)
            token = self._new_token()
            self._tokens[token] = (r.room, -1)
            self._out.append(FenceScatter(token, r.room))
            return
        DECODE_ROOM.move(r, _T.FAIL, r.room)
        self._return_pages_after_fence(r)
        self._settle(r)

    def _return_pages_after_fence(self, r: ReaderRoom) -> None:
        """Staged rooms: only scatters write the KV pages, and they are fenced now."""
        if r.path != DIRECT:
            self._free_pages(r)

    def _free_pages(self, r: ReaderRoom) -> None:
        if not r.pages_returned:
            r.pages_returned = True
            self._out.append(FreePages(r.room, r.pages))

    def _acknowledge(self, r: ReaderRoom, peer_id: str, *, safe: bool) -> None:
        """`peer_id` knows the room ended (or is gone); with `safe`, none of its writes can land any more."""
        r.acked[peer_id] = None
        if safe:
            r.safe[peer_id] = None
            r.safe_at.pop(peer_id, None)
        self._answered("abort", peer_id, r.room)
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.rooms.pop(r.room, None)

    def _settle(self, r: ReaderRoom) -> None:
        """QUARANTINED: release ring space and pages once no write can land; forget once every writer knows."""
        if not DECODE_ROOM.can(r, _T.RELEASE) or r.unsafe():
            return
        if not r.regions_freed:
            r.regions_freed = True
            for chunk in r.chunks.values():
                if chunk.region is not None:
                    self._free_region(chunk)
        self._free_pages(r)
        if not r.unacked():
            DECODE_ROOM.move(r, _T.FORGET, r.room)
            self._forget(r, r.reason)

    def _forget(self, r: ReaderRoom, reason: str | None) -> None:
        """The room just moved to FORGOTTEN: drop it, and remember it as closed."""
        del self._rooms[r.room]
        self._retrier.stop_room(r.room)
        self._closed.remember(r.room, reason)
        for peer_id in r.writers:
            peer = self._peers.get(peer_id)
            if peer is not None:
                peer.rooms.pop(r.room, None)
