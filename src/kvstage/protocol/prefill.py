"""PrefillEndpoint: the sans-I/O state machine of one prefill rank, the writer side of every room it computes.

Owns the prefill side of every room: which decode ranks this rank writes to (from the head plan), the
metadata of each (a "link"), staging requests in chunk production order (R11), parking chunks until their
ring region is free (R9), one bulk write per chunk and link (or page-to-page writes on the direct path, R12),
ChunkReady notices retried until acknowledged (R4; the last chunk's carries the room's aux row from its completing
KVReady, aux.py), and the abort protocol: an abort is acknowledged, and RoomFailed reported, only once no write of
the room is in flight (R6). prefill_rooms.py has the records it keeps per room, link and chunk.

Room states and the chunk states of each link: `states.PREFILL_ROOM` and `states.PREFILL_CHUNK` are the tables
(docs/protocol.md shows them). Every guard on a state asks the table's `can`, and every change goes through its
`move`, which refuses an edge not in the table. A grant is used only in REQUESTED; duplicates are counted. A
room is forgotten, and remembered in a bounded closed-room record, after its last state.

Inbound checks (R10, B1): Metadata is checked (metadata.py) against this rank's layout and TP and, once attached,
against the room; metadata of rooms not yet attached is capped per peer (rooms) and in all (page ids) and expires
with its ttl; grants are checked for chunk range and region size; unknown rooms allocate nothing. Called by runtime/
and sim/.
"""

from __future__ import annotations

from kvstage.errors import ConfigError, InvalidRequest
from kvstage.layout import WriterBlock, page_slice
from kvstage.protocol import reasons
from kvstage.protocol.actions import RoomFailed, RoomSucceeded, WriteDirect, WriteRegion
from kvstage.protocol.base import EndpointCore, Peer
from kvstage.protocol.codec import Codec
from kvstage.protocol.config import PrefillConfig
from kvstage.protocol.events import AbortRoom, AttachRoom, ComputeScheduled, KVReady
from kvstage.protocol.messages import (
    Abort,
    AbortAck,
    ChunkAck,
    Envelope,
    Grant,
    GrantRefused,
    Metadata,
    MetadataAck,
    StagingRequest,
)
from kvstage.protocol.metadata import attached_metadata_problem, metadata_problem
from kvstage.protocol.prefill_rooms import (
    Link,
    WriterChunk,
    WriterRoom,
    kv_ready_problem,
    write_failure,
    writer_targets,
)
from kvstage.protocol.states import PREFILL_CHUNK, PREFILL_ROOM, ChunkTrigger, PrefillRoomState, PrefillTrigger
from kvstage.ring import Allocation, Watermark, region_ready

__all__ = ["PrefillEndpoint", "PrefillRoomState"]

_ZERO = Watermark(0, 0)
_T = PrefillTrigger
_C = ChunkTrigger


class PrefillEndpoint(EndpointCore):
    """One prefill rank. `handle(event, now) -> list[Action]`; see kvstage.protocol for the API."""

    ROLE = "prefill"

    def __init__(self, config: PrefillConfig, session: int, *, codec: Codec | None = None) -> None:
        super().__init__(config.peer_id, session, config.timing, config.limits, codec)
        self.config = config
        self._rooms: dict[int, WriterRoom] = {}
        self._pending: dict[int, dict[str, tuple[Metadata, float]]] = {}  # metadata before AttachRoom
        self._pending_pages = 0  # page ids of the Metadata in _pending
        self._tokens: dict[int, tuple[int, str, int]] = {}  # write token -> (room, decode peer, chunk)
        self._event_handlers.update(
            {
                AttachRoom: self._on_attach,
                ComputeScheduled: self._on_compute_scheduled,
                KVReady: self._on_kv_ready,
                AbortRoom: self._on_abort_room,
            }
        )
        self._body_handlers.update(
            {
                Metadata: self._on_metadata,
                Grant: self._on_grant,
                GrantRefused: self._on_grant_refused,
                ChunkAck: self._on_chunk_ack,
                Abort: self._on_abort,
                AbortAck: self._on_abort_ack,
            }
        )

    # ---- introspection ----------------------------------------------------------------------------------------
    def open_rooms(self) -> frozenset[int]:
        return frozenset(self._rooms)

    def room_state(self, room: int) -> PrefillRoomState | None:
        r = self._rooms.get(room)
        return None if r is None else r.state

    def parked_count(self) -> int:
        return sum(len(peer.parked) for peer in self._peers.values())

    def pending_metadata(self) -> int:
        return sum(len(entries) for entries in self._pending.values())

    def is_quiescent(self) -> bool:
        return (
            not self._rooms
            and not self._pending
            and not self._tokens
            and not len(self._retrier)
            and not self.parked_count()
        )

    # ---- engine events ----------------------------------------------------------------------------------------
    def _on_attach(self, event: AttachRoom) -> None:
        cfg = self.config
        if event.room in self._rooms:
            raise InvalidRequest(f"room {event.room} is already attached on {cfg.peer_id}; room ids are unique")
        if event.room in self._closed:
            reason = self._closed[event.room]
            if reason is None:
                raise InvalidRequest(f"room {event.room} already completed on {cfg.peer_id}; room ids are unique")
            self.stats.failures[reason] += 1  # decode aborted it before the engine attached it
            self._out.append(RoomFailed(event.room, reason))
            self._abort_pending(event.room, reason)  # other decode ranks of the room learn it now
            return
        if event.num_tokens < 1 or event.claim_s < 0:
            raise InvalidRequest(f"room {event.room}: num_tokens must be positive and claim_s >= 0, got "
                                 f"{event.num_tokens} and {event.claim_s}")  # fmt: skip
        try:
            targets = writer_targets(self.config, event.room, event.decode_tp)
        except ConfigError as exc:
            raise InvalidRequest(f"room {event.room}: decode_tp={event.decode_tp} is unusable: {exc}") from exc
        self.stats.rooms_opened += 1
        r = WriterRoom(event.room, event.num_tokens, event.decode_tp, event.deadline, targets, prompt=event.prompt,
                       claim_s=event.claim_s)  # fmt: skip
        if event.decode_tp and not r.targets:  # every head this rank holds is written by a replica
            self._succeed(r, _T.ATTACH_NOTHING)
            return
        PREFILL_ROOM.move(r, _T.ATTACH, r.room)
        self._rooms[r.room] = r
        self._deadlines.push(r.deadline, r.room)
        for peer_id, (metadata, _) in self._pending.pop(r.room, {}).items():
            self._pending_pages -= len(metadata.pages)
            peer = self._peers.get(peer_id)
            if peer is not None:
                self._adopt(r, peer, metadata)

    def _on_compute_scheduled(self, event: ComputeScheduled) -> None:
        r = self._engine_room(event.room)
        if r is not None:
            r.scheduled = max(r.scheduled, min(event.end_tokens, r.num_tokens))
            self._pump(r)

    def _on_kv_ready(self, event: KVReady) -> None:
        r = self._engine_room(event.room)
        if r is None:
            return
        if (problem := kv_ready_problem(r, event, self.config.layout.page_size, self.limits.max_aux_bytes)) is not None:
            raise InvalidRequest(problem)
        r.take_ready(event)
        if (claim_by := r.await_claim(self._now)) is not None:
            self._deadlines.push(claim_by, r.room)
        self._pump(r)

    def _on_abort_room(self, event: AbortRoom) -> None:
        reason = event.reason if event.reason in reasons.FAILURE_REASONS else reasons.ABORTED_BY_PREFILL
        if event.room not in self._rooms and event.room not in self._closed:
            # the engine gave the request up before computing any of it: its decode ranks learn it now (those
            # whose Metadata is here) or when their Metadata comes, instead of at the room's deadline
            self._closed.remember(event.room, reason)
            self._abort_pending(event.room, reason)
            return
        r = self._engine_room(event.room)
        if r is not None:
            self._fail(r, reason)

    def _abort_pending(self, room: int, reason: str) -> None:
        """Abort `room` towards every decode rank whose Metadata waits for the engine to attach it."""
        for peer_id in list(self._pending.get(room, {})):
            self._send(peer_id, Abort(room=room, reason=reason))
            self._drop_pending(room, peer_id)

    def _engine_room(self, room: int) -> WriterRoom | None:
        """The ACTIVE room an engine call names; None if it already ended; InvalidRequest if never attached."""
        r = self._rooms.get(room)
        if r is None and room not in self._closed:
            raise InvalidRequest(f"room {room} is not attached on {self.peer_id}")
        return r if r is not None and PREFILL_ROOM.can(r, _T.COMPUTE) else None

    # ---- metadata ---------------------------------------------------------------------------------------------
    def _on_metadata(self, peer: Peer, m: Metadata) -> None:
        r = self._rooms.get(m.room)
        if r is not None:
            self._adopt(r, peer, m)
            return
        if m.room in self._closed:
            reason = self._closed[m.room]
            self._send(peer.peer_id, MetadataAck(room=m.room) if reason is None else Abort(room=m.room, reason=reason))
            return
        problem = metadata_problem(self.config, m)
        capped = self._pending_cap(peer, m)
        if problem is not None or capped is not None:
            self.stats.reject(problem or str(capped))
            why = reasons.BAD_METADATA if problem else reasons.OVERLOADED
            self._send(peer.peer_id, Abort(room=m.room, reason=why))
            return
        peer.sent_metadata = True
        entries = self._pending.setdefault(m.room, {})
        if peer.peer_id in entries:
            self.stats.duplicates += 1
        else:
            expires = self._now + m.ttl_s
            entries[peer.peer_id] = (m, expires)
            self._pending_pages += len(m.pages)
            peer.rooms[m.room] = None
            self._deadlines.push(expires, m.room)
        self._send(peer.peer_id, MetadataAck(room=m.room))

    def _pending_cap(self, peer: Peer, m: Metadata) -> str | None:
        """Why `m` may not wait for its room's attach (None: it may, or it already waits): the peer's room cap, or
        the page ids of all waiting Metadata (their decoded objects, about 40 bytes an id)."""
        if peer.peer_id in self._pending.get(m.room, {}):
            return None
        if len(peer.rooms) >= self.limits.max_rooms_per_peer:
            return "room cap of the peer reached"
        if self._pending_pages + len(m.pages) > self.limits.max_pending_pages:
            return "pending metadata pages cap reached"
        return None

    def _adopt(self, r: WriterRoom, peer: Peer, m: Metadata) -> None:
        """Link `r` to the decode rank that sent `m` (idempotent), or fail the room if `m` does not fit it."""
        if m.bystander:
            self._stand_by(r, peer, m)
            return
        link = r.links.get(peer.peer_id)
        if link is not None:
            self.stats.duplicates += 1
            self._send(peer.peer_id, MetadataAck(room=r.room))
            return
        if not PREFILL_ROOM.can(r, _T.METADATA):
            self._send(peer.peer_id, Abort(room=r.room, reason=r.reason))  # no link, so no write to it
            return
        problem = attached_metadata_problem(self.config, m, r.num_tokens, r.decode_tp or m.decode_tp, r.ranks, r.prompt)
        if problem is None and not r.decode_tp:  # the first decode rank's Metadata says decode's TP size
            r.decode_tp, r.targets = m.decode_tp, writer_targets(self.config, r.room, m.decode_tp)
        if problem is not None:
            self.stats.reject(problem)
            self._send(peer.peer_id, Abort(room=r.room, reason=reasons.BAD_METADATA))
            self._fail(r, reasons.BAD_METADATA)
            return
        peer.sent_metadata = True
        link = Link.from_metadata(self.config, peer.peer_id, m)
        r.links[peer.peer_id] = link
        r.ranks[m.decode_rank] = peer.peer_id
        peer.rooms[r.room] = None
        self._send(peer.peer_id, MetadataAck(room=r.room))
        self._pump_link(r, link)

    def _stand_by(self, r: WriterRoom, peer: Peer, m: Metadata) -> None:
        """Decode rank 0's notice that this rank writes to no decode rank in `r`: a room attached without decode's TP
        succeeds, having nothing to write. A notice that does not fit is refused and changes nothing."""
        peer.rooms.pop(r.room, None)
        decode_tp = r.decode_tp or m.decode_tp
        problem = attached_metadata_problem(self.config, m, r.num_tokens, decode_tp, r.ranks, r.prompt)
        if problem is not None or r.links or not PREFILL_ROOM.can(r, _T.SUCCEED):
            self.stats.reject(problem or "a writes-nothing notice for a room that is linked or ending")
            self._send(peer.peer_id, Abort(room=r.room, reason=reasons.BAD_METADATA))
            return
        self._send(peer.peer_id, MetadataAck(room=r.room))
        r.decode_tp = decode_tp
        self._succeed(r, _T.SUCCEED)

    # ---- chunk flow -------------------------------------------------------------------------------------------
    def _pump(self, r: WriterRoom) -> None:
        for link in list(r.links.values()):
            if not PREFILL_ROOM.can(r, _T.COMPUTE):
                return
            self._pump_link(r, link)

    def _pump_link(self, r: WriterRoom, link: Link) -> None:
        """R11: request staging in chunk order for chunks about to be computed; write whatever can be written."""
        window = self.limits.max_chunks_ahead
        while link.next_request < link.num_chunks and link.unwritten < window:
            index = link.next_request
            if link.span(index).start >= r.scheduled:
                break
            chunk = link.chunks[index] = WriterChunk()
            PREFILL_CHUNK.move(chunk, _C.REQUEST, (r.room, index))
            link.next_request += 1
            link.unwritten += 1
            self._request("stage", link.peer_id, StagingRequest(room=r.room, chunk=index), index)
        for index, chunk in list(link.chunks.items()):
            if PREFILL_CHUNK.can(chunk, _C.WRITE):
                self._try_write(r, link, index, chunk)  # never fails the room

    def _try_write(self, r: WriterRoom, link: Link, index: int, chunk: WriterChunk) -> None:
        """Write a granted chunk once its KV is computed and (staged) its region is ready; else park it (R9)."""
        span = link.span(index)
        if span.end > r.ready:
            return
        assert chunk.region is not None
        peer = self._peers[link.peer_id]
        key = (r.room, index)
        if link.plan_full is not None and not region_ready(chunk.region, peer.watermark or _ZERO):
            peer.parked[key] = None
            return
        if not self._leased(peer):  # R13: no write without a lease; the peer's next frame
            peer.parked[key] = None  # renews it (and re-checks this chunk)
            peer.lease_parked = True
            self.stats.lease_waits += 1
            return
        peer.parked.pop(key, None)
        PREFILL_CHUNK.move(chunk, _C.WRITE, key)
        token = self._new_token()
        self._tokens[token] = (r.room, link.peer_id, index)
        r.in_flight += 1
        page_size = self.config.layout.page_size  # this rank's pages; decode's may be larger or smaller
        src_pages, src_offset = r.pages[page_slice(span.start, span.end, page_size)], span.start % page_size
        assert peer.incarnation is not None  # a grant came from it
        dst_session = peer.incarnation[0]
        if link.plan_full is None:
            self._out.append(
                WriteDirect(
                    token,
                    link.peer_id,
                    r.room,
                    index,
                    src_pages,
                    link.meta.pages[link.grid.pages_of(span)],
                    span.num_tokens,
                    link.transfer,
                    self.session,
                    self.epoch_towards(peer.peer_id),
                    dst_session,
                    src_offset,
                )
            )
            return
        block: WriterBlock = link.plan(index).block_of(self.config.rank)
        self._out.append(
            WriteRegion(
                token,
                link.peer_id,
                r.room,
                index,
                src_pages,
                span.num_tokens,
                span.start,
                block,
                chunk.region,
                self.session,
                self.epoch_towards(peer.peer_id),
                dst_session,
                src_offset,
            )
        )

    def _on_heard(self, peer: Peer, envelope: Envelope) -> None:
        """R9/R13: a higher watermark, or a renewed lease, may make parked chunks writable: re-check them in grant
        order."""
        if not (peer.raise_watermark(envelope.watermark) or (peer.lease_parked and self._leased(peer))):
            return
        peer.lease_parked = False
        for room, index in list(peer.parked):  # a parked chunk is GRANTED; it leaves when written or failed
            found = self._link_of(peer, room)
            assert found is not None, f"chunk {index} of room {room} is parked, but the room is not active"
            r, link = found
            self._try_write(r, link, index, link.chunks[index])

    def _leased(self, peer: Peer) -> bool:
        return self._now < self.lease_until(peer.peer_id)

    def _link_of(self, peer: Peer, room: int) -> tuple[WriterRoom, Link] | None:
        r = self._rooms.get(room)
        if r is None or not PREFILL_ROOM.can(r, _T.WRITE):
            return None
        link = r.links.get(peer.peer_id)
        return None if link is None else (r, link)

    def _on_grant(self, peer: Peer, g: Grant) -> None:
        found = self._link_of(peer, g.room)
        if found is None:
            self.stats.stale_dropped += 1
            return
        r, link = found
        if g.chunk >= link.num_chunks:
            self.stats.reject("chunk index out of range")
            return
        chunk = link.chunks.get(g.chunk)
        if chunk is None or not PREFILL_CHUNK.can(chunk, _C.GRANT):
            self.stats.duplicates += 1
            return
        if link.plan_full is None and g.epoch != link.meta.epoch:
            self.stats.stale_dropped += 1
            return
        if link.plan_full is not None and (
            g.end - g.offset < link.plan(g.chunk).total_bytes or (link.meta.ring_bytes and g.end > link.meta.ring_bytes)
        ):
            self.stats.reject("grant smaller than the chunk or outside the ring")
            self._fail(r, reasons.PROTOCOL_VIOLATION)
            return
        self._answered("stage", peer.peer_id, r.room, g.chunk)
        chunk.region = Allocation(g.epoch, g.round, g.offset, g.end)
        PREFILL_CHUNK.move(chunk, _C.GRANT, (r.room, g.chunk))
        self._try_write(r, link, g.chunk, chunk)

    def _on_grant_refused(self, peer: Peer, m: GrantRefused) -> None:
        self.stats.refusals_received += 1
        found = self._link_of(peer, m.room)
        if found is None:
            return
        r, link = found
        chunk = link.chunks.get(m.chunk)
        if chunk is None or not PREFILL_CHUNK.can(chunk, _C.REFUSED) or m.reason == reasons.UNKNOWN_ROOM:
            return  # R2: an unknown room is retried (the request stays outstanding) until the deadline
        self._fail(r, reasons.ROOM_CLOSED if m.reason == reasons.ROOM_CLOSED else reasons.PROTOCOL_VIOLATION)

    def _on_chunk_ack(self, peer: Peer, m: ChunkAck) -> None:
        found = self._link_of(peer, m.room)
        chunk = None if found is None else found[1].chunks.get(m.chunk)
        if found is None or chunk is None or not PREFILL_CHUNK.can(chunk, _C.ACK):
            self.stats.duplicates += 1
            return
        r, link = found
        self._answered("ready", peer.peer_id, r.room, m.chunk)
        PREFILL_CHUNK.move(chunk, _C.ACK, (r.room, m.chunk))
        del link.chunks[m.chunk]
        link.acked += 1
        if link.acked == link.num_chunks:
            r.links_done += 1
            if r.links_done == len(r.targets):
                self._succeed(r, _T.SUCCEED)

    def _succeed(self, r: WriterRoom, trigger: PrefillTrigger) -> None:
        PREFILL_ROOM.move(r, trigger, r.room)
        self.stats.rooms_succeeded += 1
        self._out.append(RoomSucceeded(r.room))
        self._forget(r, None)

    # ---- completions, timers, peers ---------------------------------------------------------------------------
    def _on_token(self, token: int, ok: bool, reason: str, peer_gone: bool) -> None:
        entry = self._tokens.pop(token, None)
        if entry is None:
            self.stats.reject("unknown completion token")
            return
        room, peer_id, index = entry
        r = self._rooms[room]  # a room with a write in flight is never forgotten
        r.in_flight -= 1
        if not PREFILL_ROOM.can(r, _T.WRITTEN):  # DRAINING: a failed room's writes only count down
            if not r.in_flight:
                self._drained(r)
            return
        if not ok:  # a write that failed because decode is gone ends the room as the liveness check would
            self._fail(r, write_failure(reason, peer_gone))
            return
        link = r.links[peer_id]
        chunk = link.chunks[index]
        assert chunk.region is not None
        PREFILL_CHUNK.move(chunk, _C.WRITTEN, (r.room, index))
        link.unwritten -= 1
        self._request("ready", peer_id, link.ready_notice(r, index, chunk.region.epoch), index)
        self._pump_link(r, link)

    def _dead_after_s(self) -> float:
        return self.timing.decode_dead_after_s  # every peer is a decode rank (or a stranger): no write lands here

    def _room_deadline(self, room: int) -> float:
        r = self._rooms.get(room)
        if r is not None:
            return r.deadline
        return max((expires for _, expires in self._pending.get(room, {}).values()), default=self._now)

    def _deadline_live(self, when: float, room: int) -> bool:
        r = self._rooms.get(room)
        if r is not None:
            return PREFILL_ROOM.can(r, _T.FAIL) and r.alarm(when) is not None
        return any(expires == when for _, expires in self._pending.get(room, {}).values())

    def _on_deadline(self, when: float, room: int) -> None:
        r = self._rooms.get(room)
        if r is not None:
            if PREFILL_ROOM.can(r, _T.FAIL) and (reason := r.alarm(when)) is not None:
                self._fail(r, reason)
            return
        entries = self._pending.get(room)
        for peer_id, (_, expires) in list((entries or {}).items()):
            if expires <= when:
                self._drop_pending(room, peer_id)

    def _drop_pending(self, room: int, peer_id: str) -> None:
        entries = self._pending.get(room)
        entry = None if entries is None else entries.pop(peer_id, None)
        if entries is None or entry is None:
            return
        self._pending_pages -= len(entry[0].pages)
        if not entries:
            del self._pending[room]
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.rooms.pop(room, None)

    def _fail_by_id(self, room: int, peer_id: str, reason: str) -> None:
        r = self._rooms.get(room)
        if r is not None and peer_id in r.links:
            self._fail(r, reason)

    def _peer_lost(self, peer: Peer, room: int, reason: str) -> None:
        r = self._rooms.get(room)
        link = None if r is None else r.links.get(peer.peer_id)
        if reason == reasons.FENCED_BY_PEER and link is not None and not link.holds_grants():
            return  # nothing was granted under the fenced incarnation: its requests go on under the new epoch
        peer.rooms.pop(room, None)
        if r is None:
            self._drop_pending(room, peer.peer_id)
            return
        r.lost[peer.peer_id] = None
        self._fail(r, reason)
        self._acknowledged(r, peer.peer_id)

    # ---- aborts (R6) ------------------------------------------------------------------------------------------
    def _on_abort(self, peer: Peer, m: Abort) -> None:
        r = self._rooms.get(m.room)
        if r is None:
            had_metadata = m.room in self._pending and peer.peer_id in self._pending[m.room]
            self._drop_pending(m.room, peer.peer_id)
            if m.room not in self._closed and (had_metadata or peer.sent_metadata):
                # a later AttachRoom fails at once; only a decode rank (a peer whose Metadata this rank accepted)
                # can doom a room ahead: a stray Abort from any other peer cannot
                self._closed.remember(m.room, reasons.ABORTED_BY_DECODE)
            self._send(peer.peer_id, AbortAck(room=m.room))  # nothing of ours can land: no room, no write
            return
        r.owe_ack[peer.peer_id] = None
        if PREFILL_ROOM.can(r, _T.FAIL):
            self._fail(r, reasons.ABORTED_BY_DECODE)
        elif PREFILL_ROOM.can(r, _T.ACKNOWLEDGE):
            self._send(peer.peer_id, AbortAck(room=r.room))
            self._acknowledged(r, peer.peer_id)

    def _on_abort_ack(self, peer: Peer, m: AbortAck) -> None:
        r = self._rooms.get(m.room)
        if r is None or not PREFILL_ROOM.can(r, _T.ACKNOWLEDGE) or peer.peer_id not in r.awaiting:
            self.stats.duplicates += 1
            return
        self._acknowledged(r, peer.peer_id)

    def _fail(self, r: WriterRoom, reason: str) -> None:
        """Fail an ACTIVE room (idempotent): stop asking and writing, then drain in-flight writes."""
        if not PREFILL_ROOM.can(r, _T.FAIL):
            return
        r.reason = reason
        self.stats.failures[reason] += 1
        PREFILL_ROOM.move(r, _T.FAIL, r.room)
        self._retrier.stop_room(r.room)
        for peer_id, link in r.links.items():
            peer = self._peers.get(peer_id)
            if peer is not None:
                for index in link.chunks:
                    peer.parked.pop((r.room, index), None)
        if not r.in_flight:
            self._drained(r)

    def _drained(self, r: WriterRoom) -> None:
        """No write of the room can land any more: report, acknowledge aborts, tell the other decode ranks."""
        PREFILL_ROOM.move(r, _T.DRAINED, r.room)
        self._out.append(RoomFailed(r.room, r.reason))
        for peer_id in {**r.links, **r.owe_ack}:
            if peer_id in r.owe_ack:
                self._send(peer_id, AbortAck(room=r.room))
            elif peer_id not in r.lost:
                r.awaiting[peer_id] = None
                self._request("abort", peer_id, Abort(room=r.room, reason=r.reason))
        if not r.awaiting:
            PREFILL_ROOM.move(r, _T.FORGET, r.room)
            self._forget(r, r.reason)

    def _acknowledged(self, r: WriterRoom, peer_id: str) -> None:
        """`peer_id` knows the room failed; forget the room once every decode rank does."""
        if peer_id in r.awaiting:
            del r.awaiting[peer_id]
            self._answered("abort", peer_id, r.room)
        if PREFILL_ROOM.can(r, _T.FORGET) and not r.awaiting:
            PREFILL_ROOM.move(r, _T.FORGET, r.room)
            self._forget(r, r.reason)

    def _forget(self, r: WriterRoom, reason: str | None) -> None:
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        self._retrier.stop_room(r.room)
        self._closed.remember(r.room, reason)
        for peer_id in r.links:
            peer = self._peers.get(peer_id)
            if peer is not None:
                peer.rooms.pop(r.room, None)
