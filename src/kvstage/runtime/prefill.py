"""`PrefillAgent`: the prefill rank's agent. It gathers granted chunks and writes them to decode peers.

Owns: the local source staging buffer (allocated from the data transport, managed by a `StagingRing`), the imported
rings and pools of decode peers keyed by the decode session that published them, and the writes in flight, at most
`AgentConfig.writes_per_peer` per decode peer (the rest wait in order), and each active room's slots (its pages
looked up once per `kv_ready`, on the reactor). Staged path: gather the chunk's heads into a staging slot, queued by
the reactor on the agent's stream after the engine's KV-ready event (on the CPU: copied in place), taking a view of
the room's slots, then one bulk write into the decode ring: queued at once behind the gather on the device where the
transport orders writes there (cuda_ipc: no host wait between the two), else posted once the gather's fence is
done (polled each turn). Direct path (matched TP): one write per contiguous run, straight into the decode rank's KV:
of each (layer, K/V, page) slice between `KVPool`s, of whole (layer, block)s between engines' own KV caches in
vLLM's CPU format (dataplane/engine_blocks.py, one prepared list of runs per chunk); a direct write between unlike
layouts fails its room with the reason.

Invariants: a gather starts only once its staging slot no longer overlaps a write still in flight; a write goes only
into memory of the decode session that granted it (`dst_session`), never into the ring or pool of a restarted
incarnation (a grant from a newer session waits, bounded by decode's liveness timeout, for that session's record); a
write is posted only while `endpoint.may_post` holds (R13: this writer's lease towards its decode peer, re-checked at
the moment of posting, and the epoch the write was emitted under still current; a write waits for a lapsed lease, as
does one its transport refused for one before any byte moved, and fails unposted once the peer is fenced or has
fenced this writer's epoch); every write ends in exactly one Completion, queued ones included (a completion frees its
peer's window for the next); a decode peer's descriptors are imported on the importer thread, never on the reactor
(NIXL connects inside an import, seen blocking 11 s), and writes to it wait for them (imports.py); a decode peer that
still answers while a write to it fails as disconnected, on a backend that connects only at import (NIXL), has its
imports dropped once no write to it is in flight, and made again at a later write, at most once per IMPORT_RETRY_S
(`_reconnect`); a room's slots are kept only while the endpoint holds the room ACTIVE and dropped with its outcome,
and a gather uses them only for the very pages its write names. Called by prefill engines through `kvstage.runtime`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, assert_never

import torch

from kvstage.dataplane import KVPool, KVStore, PoolGeometry, RequestSlots, gather_slots, plan_direct_slices
from kvstage.dataplane.engine_blocks import EngineBlocks, block_runs
from kvstage.errors import ConfigError, InvalidRequest, KVStageError, StagingOversized
from kvstage.protocol import (
    Action,
    AttachRoom,
    ComputeScheduled,
    FencePeer,
    FenceScatter,
    FreePages,
    KVReady,
    PrefillConfig,
    PrefillEndpoint,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.prefill import PrefillRoomState
from kvstage.protocol.reasons import LEASE_EXPIRED
from kvstage.ring import Allocation, StagingRing, region_ready
from kvstage.runtime.agent import BaseAgent
from kvstage.runtime.config import AgentConfig, AgentSnapshot, RoomOutcome
from kvstage.runtime.imports import IMPORT_RETRY_S, PeerImports
from kvstage.runtime.reactor import CopyDone
from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.data import (
    LocalRegion,
    RemoteRegion,
    encode_descriptor,
)

log = logging.getLogger(__name__)

#: Reasons given to a write the runtime cannot carry out (logged; the room fails with "transfer failed").
NO_RING = "no staging ring known for the decode peer"
STALE_RING = "the decode peer restarted since it granted this region"
NO_LOCAL_POOL = "this rank's KV pool is on {device}; the data transports write host memory, so no direct path"
NO_ENGINE_DIRECT = "the two ranks' KV layouts differ (a KVPool and an engine's own, or two engines' blocks unlike)"
NO_POOL = "the decode peer exported no KV pool for the direct path (the local backend cannot export engine memory)"
FENCED_PEER = "the decode peer was fenced before this write could be posted"
FENCED_BY_DECODE = "the decode peer fenced this writer's epoch before this write could be posted"
RECONNECTING = "the connection to the decode peer failed and is being made again before this write could be posted"


@dataclass(frozen=True, slots=True)
class _RoomSlots:
    """An active room's pages (as the latest KVReady gave them) and their slots, looked up once; `ready` is the
    latest KVReady's end."""

    pages: tuple[int, ...]
    slots: RequestSlots
    ready: int

    def of(self, action: WriteRegion, page_size: int) -> torch.Tensor | None:
        """The chunk's slots (a view), or None when the write's pages are not the ones looked up."""
        first = action.token_start // page_size
        if self.pages[first : first + len(action.src_pages)] != action.src_pages:
            return None
        return self.slots.range(action.token_start, action.token_start + action.num_tokens)


@dataclass(slots=True)
class _Write:
    """One write in flight: staged (a slot of the local staging buffer) or direct (slices of the KV pool)."""

    action: WriteRegion | WriteDirect
    remote: RemoteRegion
    nbytes: int
    slot: Allocation | None = None
    started: float = 0.0
    #: the gather's CUDA event (staging on the GPU): the write is ordered after it on the device
    after: torch.cuda.Event | None = None


def _same_start(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether the shorter of two page lists begins the longer (a request's pages only grow)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


#: A write ready to go and waiting for its peer's window: the write, its (src, dst, length) runs, its source.
_Ready = tuple[_Write, list[tuple[int, int, int]], LocalRegion]


class PrefillAgent(BaseAgent):
    """Prefill rank: gathers each granted chunk into local staging and bulk-writes it to the decode ring (staged
    path), or writes the chunk's pages straight into the decode pool (direct path, matched TP)."""

    role = "prefill"
    peer_role = "decode"
    endpoint: PrefillEndpoint

    def __init__(self, config: AgentConfig, kv: KVStore) -> None:
        if config.writes_per_peer < 1:
            raise ConfigError(f"writes_per_peer must be at least 1, got {config.writes_per_peer}")
        super().__init__(config, kv)
        # decode peer -> (its session, its ring) and (its session, its KV, where its pages lie: a KVPool's geometry,
        # or an engine's blocks)
        self._reconnecting: set[str] = set()  # decode peers whose imports go once their writes in flight end
        self.imports: PeerImports  # made with the transport, at start (`_setup_memory`)
        self._slab = StagingRing(config.staging_bytes, 64)
        self._waiting: deque[_Write] = deque()
        self._in_flight: dict[int, _Ready] = {}  # transfer id -> the write posted under it
        self._gathering: deque[tuple[_Write, CopyDone]] = deque()  # staged writes whose gather is on the device
        self._unresolved: list[tuple[float, WriteRegion | WriteDirect]] = []  # waiting for a newer decode record
        self._queued: dict[str, deque[_Ready]] = {}  # decode peer -> ready writes waiting for its window
        self._slots: dict[int, _RoomSlots] = {}  # active room -> its pages' slots, looked up at kv_ready
        self.staging_region: LocalRegion

    # ---- engine-facing -----------------------------------------------------------------------------------

    def attach_room(
        self, room: int, num_tokens: int, decode_tp: int, timeout_s: float, prompt: bytes = b"", claim_s: float = 0.0
    ) -> None:
        """This rank computes `room` (`num_tokens` tokens, whose digest is `prompt`; empty: unchecked) for a decode
        instance of TP `decode_tp` (0: not known yet; the room holds its pages until decode's ranks attach, for
        `timeout_s` at most, and for `claim_s` > 0 at most that long after the prompt is computed: AttachRoom)."""
        self._mailbox.put(AttachRoom(room, num_tokens, decode_tp, time.monotonic() + timeout_s, prompt, claim_s))

    def compute_scheduled(self, room: int, end_tokens: int) -> None:
        """The next forward pass computes tokens [.., end_tokens) of `room`: staging is requested for them (R11)."""
        self._mailbox.put(ComputeScheduled(room, end_tokens))

    def kv_ready(
        self,
        room: int,
        end_tokens: int,
        pages: tuple[int, ...],
        ready: torch.cuda.Event | None = None,
        aux: bytes = b"",
    ) -> None:
        """KV of tokens [0, end_tokens) is computed in `pages` (on a GPU: once `ready`, an event on the engine's
        stream, is done; gathers wait for it on the device; None on a GPU: the KV is taken as computed by what the
        engine has queued on its current stream so far); kvstage reads them until the room's outcome. `aux`: the
        room's aux row, only with the call that completes the room (end_tokens == its tokens); it reaches every
        decode rank with the room's last chunk and comes out in decode's `RoomOutcome.aux` (protocol/aux.py)."""
        if ready is None and self.pool.device.type == "cuda":
            ready = torch.cuda.current_stream(self.pool.device).record_event()
        self._claims.set_ready(room, ready)
        self._mailbox.put(KVReady(room, end_tokens, tuple(pages), bytes(aux)))

    # ---- hooks -------------------------------------------------------------------------------------------

    def _setup_memory(self) -> dict[str, bytes]:
        self.imports = PeerImports(self.transport, self._mailbox.put, self.metrics, self.peer_id)
        self.staging_region = self._host_region(self.config.staging_bytes)
        self.export_pool()  # the pool is the source of direct-path writes
        # an engine's blocks tell decode ranks whether this rank can write theirs page to page
        blocks = {} if self.engine_blocks is None else {"engine_blocks": self.engine_blocks.encode()}
        return {"staging": encode_descriptor(self.transport.export(self.staging_region)), **blocks}

    def close(self) -> None:
        if self._started:
            self.imports.close()
        super().close()

    def _make_endpoint(self) -> PrefillEndpoint:
        cfg = self.config
        return PrefillEndpoint(
            PrefillConfig(
                peer_id=self.peer_id,
                layout=cfg.layout,
                tp_size=cfg.tp_size,
                rank=cfg.rank,
                timing=cfg.timing,
                limits=cfg.limits,
            ),
            self.session,
            codec=self._codec,
        )

    def _handle(self, event: Any) -> list[Any]:
        """A KVReady that the endpoint took for an active room has its pages' slots looked up once, here; every
        gather of the room takes a view (`_RoomSlots.of`, in `_start_staged`)."""
        actions = super()._handle(event)
        if isinstance(event, KVReady) and self.endpoint.room_state(event.room) is PrefillRoomState.ACTIVE:
            self._look_up(event)
        return actions

    def _look_up(self, event: KVReady) -> None:
        """The slots of every token the event's pages hold, looked up (and the pages checked) once per room and
        reused by later KVReady events with the same pages; pages not all usable yet: only tokens [0, end_tokens)."""
        known = self._slots.get(event.room)
        if known is not None and event.end_tokens < known.ready:
            return  # an older KVReady: the endpoint keeps the newer pages too
        if known is not None and event.end_tokens <= known.slots.end and _same_start(known.pages, event.pages):
            self._slots[event.room] = replace(known, ready=event.end_tokens)  # covered by the earlier lookup
            return
        whole = len(event.pages) * self.pool.layout.page_size
        for end in dict.fromkeys((max(whole, event.end_tokens), event.end_tokens)):
            try:
                slots = self.pool.request_slots(event.pages, 0, end)
                self._slots[event.room] = _RoomSlots(event.pages, slots, event.end_tokens)
                return
            except InvalidRequest as exc:  # the gathers look up per chunk and fail the room with the reason
                log.debug("%s: room %d: no slots looked up at kv_ready: %s", self.peer_id, event.room, exc)
        self._slots.pop(event.room, None)

    def _execute(self, action: Action) -> None:
        match action:
            case WriteRegion() | WriteDirect():
                self.trace.mark(action.room, action.chunk, "issued", action.peer)
                self._issue(action)
            case RoomSucceeded():
                self._room_ended(action.room)
                self._outcome(RoomOutcome(action.room, True))
            case RoomFailed():
                self._room_ended(action.room)
                self._outcome(RoomOutcome(action.room, False, action.reason))
            case Scatter() | FenceScatter() | FreePages() | Send() | FencePeer():
                raise TypeError(f"prefill agent cannot execute {action!r}")
            case _:
                assert_never(action)

    def _room_ended(self, room: int) -> None:
        """Every write of the room has completed (the endpoint ends a room only then): drop what gathers used."""
        self._slots.pop(room, None)
        self._claims.forget(room)

    def _peer_changed(self, old: PeerRecord | None, record: PeerRecord) -> None:
        if self.imports.holds(record):
            # the same incarnation again (a second lookup of it): writes already queued hold its imports, which
            # stay valid; re-importing would forget them under those writes
            return
        self._peer_fenced(record.peer_id)
        self.imports.start(record)  # writes to the peer wait in `_unresolved` until it lands

    def _peer_fenced(self, peer: str) -> None:
        self._reconnecting.discard(peer)
        self._fail_queued(peer, f"{FENCED_PEER} ({peer})")
        self.imports.drop(peer)

    def _fail_queued(self, peer: str, why: str, peer_gone: bool = False) -> None:
        """The peer's queued writes, whose target memory is about to be forgotten, fail with `why` (`peer_gone`:
        because the peer cannot be reached)."""
        for write, _, _ in self._queued.pop(peer, ()):
            self._end_unposted(write, why, peer_gone)

    def _reconnect(self, write: _Write, reason: str) -> None:
        """`write` failed as disconnected (`peer_gone`). Where the backend connects only when a peer is imported
        (`reconnects_on_import`: NIXL, whose failed UCX endpoint fails every later write at once) and the peer
        still answers (its frames renew this writer's lease) under the import the write used, drop the peer's
        imports once its writes in flight end (`_drop_when_idle`): the next write to it after IMPORT_RETRY_S
        imports it again (`PeerImports.retry`), which connects anew. At most once per IMPORT_RETRY_S per peer: writes
        under the dropped imports no longer match the peer's target, and new imports are made IMPORT_RETRY_S after
        the drop. A peer that is silent is left to the liveness check, whose fence drops its imports."""
        peer = write.action.peer
        if not self.transport.reconnects_on_import or not self._still_target(write) or peer not in self._records:
            return
        if peer in self._reconnecting or time.monotonic() >= self.endpoint.lease_until(peer):
            return
        log.warning(
            "%s: a write to decode peer %r failed as disconnected while the peer answers (%s): its imports are "
            "dropped once its writes in flight end, and made again at its next write %.0f s later",
            self.peer_id,
            peer,
            reason,
            IMPORT_RETRY_S,
        )
        self.metrics.peer_reconnected()
        self._reconnecting.add(peer)  # `_poll_transport` drops its imports once no write to it is in flight

    def _drop_when_idle(self, peer: str) -> None:
        """Drop a reconnecting peer's imports once no write to it is in flight (none is posted meanwhile). Dropping
        them closes every NIXL endpoint to the peer, the working ones too: a write still in flight on one would be
        reported failed, so its room's space could be released on decode, while bytes of it may still sit in the
        kernel's send buffer of the closed connection, to land after that."""
        if self._in_flight_to(peer):
            return
        self._reconnecting.discard(peer)
        self._fail_queued(peer, f"{RECONNECTING} ({peer})", peer_gone=True)
        self.imports.drop(peer, reconnect=True)

    def _issue(self, action: WriteRegion | WriteDirect) -> None:
        """Start (or queue) one write, after checking that the target memory belongs to the granting session."""
        target = self.imports.target(action)
        record = self._records.get(action.peer)
        if target is None and record is not None:
            self.imports.retry(record)  # an import that failed, or was dropped to reconnect, IMPORT_RETRY_S ago
        if target is None:
            reason = NO_RING if isinstance(action, WriteRegion) else NO_POOL
            if record is not None and not self.imports.loading(action.peer):
                # its import failed, or was dropped to reconnect: then, as for a killed peer, "peer dead"
                self._complete(action.token, False, reason, peer_gone=self.imports.dropped(action.peer))
            else:
                self._unresolved.append((time.monotonic(), action))
            return
        session, remote = target
        if session < action.dst_session:
            # granted by a newer incarnation whose record the resolver has not delivered yet: wait for it
            self._unresolved.append((time.monotonic(), action))
            self.resolver.want(action.peer)
            return
        if session != action.dst_session:
            # the grant came from another incarnation of the decode rank: its memory is not this one
            self._complete(action.token, False, f"{STALE_RING} (granted by session {action.dst_session}, "
                           f"the peer now runs session {session})")  # fmt: skip
            return
        if isinstance(action, WriteRegion):
            self._queue_staged(action, remote)
        else:
            self._write_direct(action, remote)

    def _retry_unresolved(self) -> None:
        """Re-issue writes whose decode record has arrived, or whose peer's import has landed; fail those that
        waited past decode's liveness timeout with no import of their peer under way (one under way is waited for: it
        ends, or the peer's fence drops it)."""
        waiting, self._unresolved = self._unresolved, []
        expired = time.monotonic() - self.config.timing.decode_dead_after_s
        for since, action in waiting:
            target = self.imports.target(action)
            if target is not None and target[0] >= action.dst_session:
                self._issue(action)
            elif since < expired and not self.imports.loading(action.peer):
                reason = NO_RING if isinstance(action, WriteRegion) else NO_POOL
                self._complete(action.token, False, f"{reason} (session {action.dst_session} never registered)")
            else:
                self._unresolved.append((since, action))

    def _queue_staged(self, action: WriteRegion, remote: RemoteRegion) -> None:
        try:
            slot = self._slab.allocate(action.block.nbytes)
        except StagingOversized as exc:
            self._complete(action.token, False, f"local staging: {exc}")
            return
        self._waiting.append(_Write(action, remote, action.block.nbytes, slot))
        self._start_ready_writes()

    def _start_ready_writes(self) -> None:
        still: deque[_Write] = deque()
        while self._waiting:
            write = self._waiting.popleft()
            assert write.slot is not None
            if region_ready(write.slot, self._slab.watermark):
                self._start_staged(write)
            else:
                still.append(write)
        self._waiting = still

    def _start_staged(self, write: _Write) -> None:
        """Gather on the agent's stream (on the CPU: now); the bulk write follows (`_gathered`)."""
        action = write.action
        assert isinstance(action, WriteRegion) and write.slot is not None
        transfer, staging, offset = action.block.transfer, self.staging_region.tensor, write.slot.offset
        known = self._slots.get(action.room)

        def job() -> int:
            self.trace.mark(action.room, action.chunk, "gather_begin", action.peer)
            heads = (transfer.src_head_start, transfer.num_heads)
            self.pool.geometry.check_heads(*heads)
            with self._claims.reading(action.room, self.device_work.stream):
                slots = None if known is None else known.of(action, self.pool.layout.page_size)
                if slots is None:  # no lookup at kv_ready (its pages were refused) or other pages: this chunk's
                    first = action.src_offset
                    slots = self.pool.slot_indices(action.src_pages, first, first + action.num_tokens)
                return gather_slots(self.pool, slots, *heads, staging, offset)

        done = self.device_work.run(job, f"gather of room {action.room} chunk {action.chunk}")
        self.trace.mark(action.room, action.chunk, "gather_end", action.peer)
        if not done.ok or done.fence.event is None or self.transport.orders_on_device:
            self._gathered(write, done)  # failed, landed (CPU), or the write is ordered after it on the device
        else:
            self._gathering.append((write, done))  # the write is posted once the gather has landed

    def _land_gathers(self) -> None:
        """Post the writes whose gathers have landed on the device (polled, never waited for)."""
        still: deque[tuple[_Write, CopyDone]] = deque()
        for write, done in self._gathering:
            try:
                landed = done.fence.done()
            except RuntimeError as exc:  # the device failed the gather
                self._gathered(write, replace(done, ok=False, reason=f"on the device: {exc}"))
                continue
            if landed:
                self._gathered(write, done)
            else:
                still.append((write, done))
        self._gathering = still

    def _gathered(self, write: _Write, done: CopyDone) -> None:
        assert isinstance(write.action, WriteRegion) and write.slot is not None
        self.trace.mark(write.action.room, write.action.chunk, "gather_seen", write.action.peer)
        if not done.ok:
            self._slab.free(write.slot)
            self._complete(write.action.token, False, f"gather failed: {done.reason}")
            return
        self._progressed()
        self.metrics.copy_done("gather", done.seconds)
        write.after = done.fence.event
        self._enqueue_write(write, [(write.slot.offset, write.action.dst_offset, write.nbytes)], self.staging_region)

    def _write_direct(self, action: WriteDirect, remote: RemoteRegion) -> None:
        """Page to page, one operation per contiguous run: of each (layer, K/V, page) slice between `KVPool`s, of
        whole (layer, block)s between engines' own KV caches."""
        if self.pool_region is None:
            self._complete(action.token, False, NO_LOCAL_POOL.format(device=self.pool.device))
            return
        try:
            runs = self._direct_runs(action, self.imports.geometry(action.peer))
        except KVStageError as exc:
            self._complete(action.token, False, f"direct plan failed: {exc}")
            return
        self._enqueue_write(_Write(action, remote, sum(run[2] for run in runs)), runs, self.pool_region)

    def _direct_runs(self, action: WriteDirect, target: PoolGeometry | EngineBlocks) -> list[tuple[int, int, int]]:
        if isinstance(target, EngineBlocks):  # `pool_region` is registered: an engine's KV has its blocks
            if self.engine_blocks is None or action.src_offset:
                raise InvalidRequest(NO_ENGINE_DIRECT)
            return block_runs(self.engine_blocks, target, action.src_pages, action.dst_pages)
        if not isinstance(self.pool, KVPool):
            raise InvalidRequest(NO_ENGINE_DIRECT)
        heads, pages, tokens = action.transfer, (action.src_pages, action.dst_pages), (0, action.num_tokens)
        geometry = self.pool.geometry
        slices = plan_direct_slices(geometry, target, heads, *pages, *tokens, src_shift=action.src_offset)
        return [run for s in slices for run in s.runs()]

    def _enqueue_write(self, write: _Write, runs: list[tuple[int, int, int]], source: LocalRegion) -> None:
        """Submit `write` now if its decode peer's window has room, else queue it behind the peer's other writes.

        The window (`AgentConfig.writes_per_peer`) keeps the link busy while chunks still land one after another,
        so decode scatters chunk k while chunk k+1 is on the wire; with every write in flight at once they would
        share the link and all land at the end, leaving every scatter after the last byte."""
        peer = write.action.peer
        self._queued.setdefault(peer, deque()).append((write, runs, source))
        self._submit_queued(peer)

    def _still_target(self, write: _Write) -> bool:
        """Whether `write`'s target memory is still its decode peer's (not fenced or replaced since it was posted)."""
        target = self.imports.target(write.action)
        return target is not None and target[1] is write.remote

    def _end_unposted(self, write: _Write, reason: str, peer_gone: bool = False) -> None:
        """A queued write will never be posted: free its staging slot and fail it."""
        if write.slot is not None:
            self._slab.free(write.slot)
        self._complete(write.action.token, False, reason, peer_gone)

    def _in_flight_to(self, peer: str) -> int:
        return sum(1 for write, _, _ in self._in_flight.values() if write.action.peer == peer)

    def _submit(self, write: _Write, runs: list[tuple[int, int, int]], source: LocalRegion) -> None:
        write.started = time.perf_counter()
        self.trace.mark(write.action.room, write.action.chunk, "posted", write.action.peer)
        self.metrics.transfer_started()
        lease = self.endpoint.lease_until(write.action.peer)  # checked again right before the bytes move
        self._in_flight[self.transport.write_batch(source, write.remote, runs, write.after, not_after=lease)] = (
            write,
            runs,
            source,
        )

    def _submit_queued(self, peer: str) -> None:
        """Post `peer`'s queued writes in order while its window has room and the endpoint lets them be posted.

        R13: a write is posted only at a moment when `endpoint.may_post` holds: this writer's lease towards the peer
        (renewed by every frame the peer sends) has not run out, and the write was emitted under the writer's
        current epoch towards the peer. Decode relies on it to know when a fenced writer's writes can no longer
        land. A write waiting for a lapsed lease is re-checked every turn; one whose target memory was forgotten
        (the peer fenced or replaced) or whose epoch has passed (the peer fenced us) fails without being posted."""
        if peer in self._reconnecting:  # its imports are dropped once its writes in flight end: post none
            return
        queued = self._queued.get(peer)
        while queued:
            write = queued[0][0]
            why, peer_gone = self._unpostable(write)  # epochs only grow: a passed epoch's writes are ahead of the
            if why:  # others (and a fence of the peer empties its queue at once, `_peer_fenced`)
                queued.popleft()
                self._end_unposted(write, why, peer_gone)
                continue
            if self._in_flight_to(peer) >= self.config.writes_per_peer:
                return
            if not self.endpoint.may_post(write.action, time.monotonic()):
                return
            self._submit(*queued.popleft())
        self._queued.pop(peer, None)

    def _unpostable(self, write: _Write) -> tuple[str, bool]:
        """Why no renewed lease may ever carry `write` (its epoch towards its peer has passed, or its target memory
        is no longer the peer's), or "" while it may still be posted; and whether that is because the peer cannot
        be reached. A write that reaches the queue after its peer's imports were dropped to reconnect (it was
        being gathered then) fails as the queued ones did (`_drop_when_idle`): as for a killed peer, "peer dead"."""
        peer = write.action.peer
        if write.action.writer_epoch != self.endpoint.epoch_towards(peer):
            return f"{FENCED_BY_DECODE} ({peer})", False
        if self._still_target(write):
            return "", False
        if self.imports.dropped(peer):
            return f"{RECONNECTING} ({peer})", True
        return f"{FENCED_PEER} ({peer})", False

    def _poll_transport(self) -> None:
        for done in self.transport.poll():
            self._progressed()
            ready = self._in_flight.pop(done.transfer_id, None)
            if ready is None:
                log.error("%s: completion for unknown transfer %d", self.peer_id, done.transfer_id)
                continue
            write = ready[0]
            self.trace.mark(write.action.room, write.action.chunk, "written", write.action.peer)
            self.metrics.transfer_finished(write.nbytes, time.perf_counter() - write.started, done.ops, done.ok)
            if not done.ok and done.reason == LEASE_EXPIRED and not done.peer_gone and self._still_target(write):
                # refused before any byte moved (the lease lapsed between posting and its first byte): it waits at
                # the head of its peer's queue for the lease to be renewed, or fails when the peer is fenced
                self._queued.setdefault(write.action.peer, deque()).appendleft(ready)
                continue
            if write.slot is not None:
                self._slab.free(write.slot)
            if not done.ok and done.peer_gone:
                self._reconnect(write, done.reason)
            # the endpoint tells "lease expired" (the write never started) from other failures by this reason
            reason = done.reason if done.ok or done.reason == LEASE_EXPIRED else f"transfer failed: {done.reason}"
            self._complete(write.action.token, done.ok, reason, done.peer_gone)
            if write.action.peer in self._reconnecting:
                self._drop_when_idle(write.action.peer)
            self._submit_queued(write.action.peer)

    def _after_turn(self) -> None:
        if self._gathering:
            self._land_gathers()
        for peer in list(self._queued):
            self._submit_queued(peer)
        if self._unresolved:
            self._retry_unresolved()
        if self._waiting:
            self._start_ready_writes()

    def _gauges(self) -> None:
        self.metrics.set_parked(self.endpoint.parked_count())

    def _busy(self) -> bool:
        return bool(self._in_flight or self._queued or self._gathering)

    def _make_snapshot(self, stats: dict[str, int]) -> AgentSnapshot:
        base = super()._make_snapshot(stats)
        return AgentSnapshot(
            open_rooms=base.open_rooms,
            quiescent=base.quiescent
            and not (
                self._in_flight
                or self._waiting
                or self._unresolved
                or self._gathering
                or self._queued
                or self._slots
                or len(self._claims)
            ),
            writes_in_flight=len(self._in_flight),
            writes_waiting=len(self._waiting) + sum(len(q) for q in self._queued.values()),
            pending_sends=base.pending_sends,
            stats=stats,
        )
