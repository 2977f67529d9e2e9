"""The part of an endpoint that does not care which side it plays: dispatch, envelopes, peers, retries, timers.

Owns, for both DecodeEndpoint and PrefillEndpoint:
- `handle(event, now)`: the single entry point; it dispatches by event type and returns the actions in order;
- envelopes: every Send carries this endpoint's peer id, session, its epoch towards that peer, a sequence
  number and (decode only) the current watermark;
- the peer table and incarnation fencing (R7, R8). A peer's incarnation is (session, epoch), compared as a
  tuple. A newer one means the old process is gone (or was fenced): it is fenced, the rooms it served are lost,
  and the new one is served at once. A fenced incarnation's frames are dropped and answered with `Fenced`, so a live
  but partitioned peer bumps its epoch towards us and is served again. A peer silent past
  `Timing.dead_after_s` (on prefill: `Timing.decode_dead_after_s`) is declared dead: its rooms are lost with reason
  "peer dead", its incarnation fenced, and it is pruned from the table (and from every broadcast). Silence counts
  only while this endpoint ran: time it was stalled itself (a heartbeat tick more than a heartbeat period late) is
  credited to every peer;
- the writer lease clocks: every envelope carries `stamp` (our `now`) and `echo` (the highest stamp heard from the
  addressee's current incarnation); an echo of one of our own stamps, from a peer, renews `lease_until(peer)`:
  the peer received a frame we sent at that time, so it heard from us then (docs/protocol.md, "Writer leases");
- retries (R4) through `Retrier`, heartbeats both ways every `Timing.heartbeat_s`, room deadlines;
- counters (`EndpointStats`) and the bounded closed-room record (R10);
- fence records released by rule, not by count: a fenced incarnation's record stays until no room it held can
  still be written (`FenceRecord.release_at`: its rooms' latest deadline, stretched by clock drift, plus
  `quarantine_s`), so a writer cut off or paused however long comes back fenced; at `Limits.max_fences` records
  still needed, new peers are refused rather than a record forgotten;
- at construction, `ConfigError` where `Limits.max_aux_bytes` leaves the last chunk's ChunkReady larger than the
  codec's `max_frame_bytes` (aux.py).

Subclasses implement the room state machines through the hooks marked "subclass". Pure: no I/O, clock or
randomness; `now` always comes from the caller. Called by decode.py and prefill.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstage.errors import ProtocolError
from kvstage.protocol import reasons
from kvstage.protocol.actions import Action, FencePeer, Send, WriteDirect, WriteRegion
from kvstage.protocol.aux import check_aux_fits
from kvstage.protocol.codec import Codec
from kvstage.protocol.config import Limits, Timing
from kvstage.protocol.events import (
    Completion,
    Event,
    Received,
    ReceivedFrame,
    SendFailed,
    Tick,
)
from kvstage.protocol.messages import (
    PROTOCOL_VERSION,
    Body,
    Envelope,
    Fenced,
    Heartbeat,
    RoomBody,
    WireWatermark,
)
from kvstage.protocol.stats import EndpointStats
from kvstage.protocol.timers import DeadlineQueue, Retrier
from kvstage.ring import Watermark

Incarnation = tuple[int, int]


@dataclass(slots=True, eq=False)
class Peer:
    """What this endpoint knows about one remote endpoint."""

    peer_id: str
    incarnation: Incarnation | None  # None until the first frame from it arrives
    last_heard: float
    rooms: dict[int, None] = field(default_factory=dict)  # rooms that still need this peer (ordered set)
    watermark: Watermark | None = None  # prefill side: highest watermark seen from this decode peer
    parked: dict[tuple[int, int], None] = field(default_factory=dict)  # prefill side: (room, chunk) parked
    lease_parked: bool = False  # prefill side: a chunk parked because the lease towards this peer had lapsed
    sent_metadata: bool = False  # prefill side: it sent Metadata this rank accepted, so it is a decode rank
    stamp_seen: float | None = None  # highest stamp heard from its current incarnation: the echo we send it
    echo: float | None = None  # latest of our own stamps that its current incarnation echoed: our lease base
    told: WireWatermark | None = None  # decode side: the watermark on the last envelope sent to it

    def raise_watermark(self, watermark: WireWatermark | None) -> bool:
        """Prefill side: take `watermark` if it is higher than the highest seen; whether it was."""
        seen = self.watermark
        if watermark is None or (seen is not None and (watermark.round, watermark.tail) <= (seen.round, seen.tail)):
            return False
        self.watermark = Watermark(watermark.round, watermark.tail)
        return True


@dataclass(frozen=True, slots=True)
class FenceRecord:
    """The highest fenced incarnation of one peer, and when (our clock) no room it held can be written any more."""

    incarnation: Incarnation
    release_at: float


class BoundedRecord(OrderedDict[Any, Any]):
    """An insertion-ordered map that forgets its oldest entries beyond `cap` (bounded tombstones)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def remember(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)


class EndpointCore(ABC):
    """Side-independent machinery; see the module docstring. Not used directly."""

    ROLE: ClassVar[str] = "endpoint"

    def __init__(self, peer_id: str, session: int, timing: Timing, limits: Limits, codec: Codec | None) -> None:
        if not 0 <= session <= 2**63 - 1:
            raise ValueError(f"session must be in 0..2**63-1, got {session}")
        self.peer_id = peer_id
        self.session = session
        self.timing = timing
        self.limits = limits
        self.codec = codec if codec is not None else Codec()
        check_aux_fits(limits.max_aux_bytes, self.codec.max_frame_bytes)
        self.stats = EndpointStats()
        self._peers: dict[str, Peer] = {}
        self._fenced: dict[str, FenceRecord] = {}  # peer id -> its fence, until no room of it can be written
        self._epochs = BoundedRecord(limits.max_peers)  # peer id -> our epoch towards it (0 if absent)
        self._closed = BoundedRecord(limits.max_closed_rooms)  # room -> failure reason, or None if it succeeded
        self._retrier = Retrier(timing.retry_initial_s, timing.retry_max_s)
        self._deadlines = DeadlineQueue()
        self._next_heartbeat: float | None = None
        self._next_token = 0
        self._seq = 0
        self._now = 0.0
        self._born: float | None = None  # our clock at our first event: an echo from before it is not ours
        self._out: list[Action] = []
        self._timer: float | None = None
        self._timer_stale = True
        self._event_handlers: dict[type, Callable[[Any], None]] = {
            Received: self._on_received,
            ReceivedFrame: self._on_frame,
            Completion: self._on_completion,
            SendFailed: self._on_send_failed,
            Tick: self._on_tick,
        }
        self._body_handlers: dict[type, Callable[[Peer, Any], None]] = {}

    # ---- public API -------------------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply `event` at time `now`; return the actions to carry out, in order."""
        self._now = now
        if self._born is None:
            self._born = now
        out = self._out = []
        handler = self._event_handlers.get(type(event))
        if handler is None:
            raise TypeError(f"{type(self).__name__} does not handle {type(event).__name__}")
        self._timer_stale = True
        handler(event)
        self._after_event()
        return out

    def tick(self, now: float) -> list[Action]:
        """Run whatever timers are due at `now` (same as `handle(Tick(), now)`)."""
        return self.handle(Tick(), now)

    def next_timer(self) -> float | None:
        """Earliest time at which `tick` has work, or None if nothing is scheduled (cached until the next event)."""
        if self._timer_stale:
            earliest = self._next_heartbeat
            for timer in (self._retrier.next_due(), self._next_deadline()):
                if timer is not None and (earliest is None or timer < earliest):
                    earliest = timer
            self._timer = earliest
            self._timer_stale = False
        return self._timer

    def accepted_bodies(self) -> frozenset[type]:
        """The body types this endpoint acts on (any other is dropped and counted, so a receiver may refuse it
        before decoding it)."""
        return frozenset(self._body_handlers) | {Heartbeat, Fenced}

    def peers(self) -> frozenset[str]:
        """Peer ids currently tracked (live or not yet declared dead)."""
        return frozenset(self._peers)

    def lease_until(self, peer_id: str) -> float:
        """Until when (in our clock) we may post a write to `peer_id`: `lease_s` after the latest of our frames it
        has echoed; 0.0 if it has echoed none (or is not tracked). Whoever posts a write checks this at posting."""
        peer = self._peers.get(peer_id)
        if peer is None or peer.echo is None:
            return 0.0
        return peer.echo + self.timing.lease_s

    def may_post(self, write: WriteRegion | WriteDirect, now: float) -> bool:
        """R13, for whoever posts a write this endpoint emitted: True while `now` (our clock) is within our lease
        towards its peer and the write was emitted under our current incarnation towards that peer. A `Fenced`
        since then started a new epoch: the peer gave those writes up (and may have reused their space), and the
        lease it renews for the new epoch must never carry them."""
        return now < self.lease_until(write.peer) and write.writer_epoch == self.epoch_towards(write.peer)

    def pending_retries(self) -> int:
        """Requests still waiting for their answer."""
        return len(self._retrier)

    def rooms_with_timers(self) -> frozenset[int]:
        """Rooms with an outstanding retry or a live deadline (Q1: none of them may be a forgotten room)."""
        live_deadlines = {room for when, room in self._deadlines.entries() if self._deadline_live(when, room)}
        return self._retrier.rooms() | live_deadlines

    # ---- subclass hooks ---------------------------------------------------------------------------------------
    @abstractmethod
    def _peer_lost(self, peer: Peer, room: int, reason: str) -> None:
        """subclass: `peer` (or the incarnation of it that `room` used) is gone; settle `room` with `reason`.

        Called for each room in `peer.rooms`; the subclass removes the room from `peer.rooms` once the room no
        longer needs that peer."""

    @abstractmethod
    def _room_deadline(self, room: int) -> float:
        """subclass: the deadline (our clock) of `room`, a room in some peer's `rooms`."""

    @abstractmethod
    def _on_deadline(self, when: float, room: int) -> None:
        """subclass: the alarm set for `room` at `when` fired."""

    @abstractmethod
    def _on_token(self, token: int, ok: bool, reason: str, peer_gone: bool) -> None:
        """subclass: the action carrying `token` completed (`peer_gone`: it failed because the peer is gone)."""

    @abstractmethod
    def _fail_by_id(self, room: int, peer_id: str, reason: str) -> None:
        """subclass: fail `room` if it is still active and `peer_id` has a part in it (used for SendFailed: a
        failed send to a peer with no part in a room, e.g. a reply to a stranger naming it, never changes it)."""

    def _watermark(self) -> WireWatermark | None:
        """subclass (decode): the watermark every outgoing envelope carries."""
        return None

    def _on_new_incarnation(self, peer: Peer) -> None:
        """subclass: a peer (re)appeared with a new incarnation (decode: send it the watermark at once)."""

    def _on_heard(self, peer: Peer, envelope: Envelope) -> None:
        """subclass (prefill): an admitted envelope may carry a higher watermark or renew the lease."""

    def _after_event(self) -> None:
        """subclass: runs after every event (decode: send a moved watermark to writers that may wait for it)."""

    def _dead_after_s(self) -> float:
        """subclass (prefill): how long a peer may be silent before it is declared dead (R8)."""
        return self.timing.dead_after_s

    # ---- sending ----------------------------------------------------------------------------------------------
    def _send(self, peer_id: str, body: Body) -> None:
        self._seq += 1
        peer = self._peers.get(peer_id)
        watermark = self._watermark()
        if peer is not None:
            peer.told = watermark
        envelope = Envelope(
            version=PROTOCOL_VERSION,
            sender=self.peer_id,
            session=self.session,
            epoch=self._epochs.get(peer_id, 0),
            seq=self._seq,
            watermark=watermark,
            body=body,
            stamp=self._now,
            echo=None if peer is None else peer.stamp_seen,
        )
        self._out.append(Send(peer_id, envelope))

    def _request(self, kind: str, peer_id: str, body: RoomBody, chunk: int = 0) -> None:
        """Send a request-type `body` now and keep re-sending it with backoff until `_answered` stops it."""
        self._send(peer_id, body)
        self._retrier.start((kind, peer_id, body.room, chunk), peer_id, body, self._now)

    def _answered(self, kind: str, peer_id: str, room: int, chunk: int = 0) -> bool:
        return self._retrier.stop((kind, peer_id, room, chunk))

    def _new_token(self) -> int:
        self._next_token += 1
        return self._next_token

    # ---- peers ------------------------------------------------------------------------------------------------
    def _ensure_peer(self, peer_id: str) -> Peer:
        """The peer entry for `peer_id`, created (heard from 'now') if the local engine names a new one."""
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = Peer(peer_id, None, self._now)
            if self._next_heartbeat is None:
                self._next_heartbeat = self._now + self.timing.heartbeat_s
        return peer

    def _admit(self, envelope: Envelope) -> Peer | None:
        """The sending peer if `envelope` comes from a live incarnation; None (dropped, counted) otherwise."""
        peer_id = envelope.sender
        incarnation = (envelope.session, envelope.epoch)
        fence = self._fenced.get(peer_id)
        if fence is not None and incarnation <= fence.incarnation and self._now < fence.release_at:
            self.stats.stale_dropped += 1
            if not isinstance(envelope.body, Fenced):
                self._send(peer_id, Fenced(session=envelope.session, epoch=envelope.epoch))
            return None
        peer = self._peers.get(peer_id)
        if peer is None:
            if len(self._peers) >= self.limits.max_peers:
                self.stats.reject("too many peers")
                return None
            if peer_id not in self._fenced and len(self._fenced) >= self.limits.max_fences:
                self._release_fences()
                if len(self._fenced) >= self.limits.max_fences:
                    self.stats.reject("fence records full")
                    return None
            peer = self._ensure_peer(peer_id)
        fresh = peer.incarnation is None or incarnation > peer.incarnation
        if fresh:
            if peer.incarnation is not None:
                self.stats.peers_restarted += 1
                self._fence(peer, reasons.PEER_RESTARTED)
            peer.incarnation = incarnation
            peer.watermark = peer.told = None
            peer.stamp_seen = peer.echo = None
        elif peer.incarnation is not None and incarnation < peer.incarnation:
            self.stats.stale_dropped += 1
            return None
        peer.last_heard = self._now
        self._take_clocks(peer, envelope)
        if fresh:
            self._on_new_incarnation(peer)
        return peer

    def _take_clocks(self, peer: Peer, envelope: Envelope) -> None:
        """Remember the peer's stamp (to echo it) and its echo of ours (our lease base), if the echo can be ours:
        a value outside [our first event, now] was not stamped by this incarnation of ours."""
        if peer.stamp_seen is None or envelope.stamp > peer.stamp_seen:
            peer.stamp_seen = envelope.stamp
        echo = envelope.echo
        born = self._born if self._born is not None else self._now
        if echo is not None and born <= echo <= self._now and (peer.echo is None or echo > peer.echo):
            peer.echo = echo

    def _fence(self, peer: Peer, reason: str) -> None:
        """`peer`'s current incarnation is gone: fence it (if it was ever heard) and settle its rooms."""
        if peer.incarnation is not None:
            self._remember_fence(peer, peer.incarnation)
            self._out.append(FencePeer(peer.peer_id, *peer.incarnation))
        for room in list(peer.rooms):
            self._peer_lost(peer, room, reason)

    def _remember_fence(self, peer: Peer, incarnation: Incarnation) -> None:
        """Fence `incarnation` (the current one of `peer`) until no room it holds can be written: the rooms'
        latest deadline, its span from now stretched by the clocks' drift, plus `quarantine_s` for a write posted
        just before it. A record still in force for an older incarnation is raised to this one, never shortened."""
        latest = max((self._room_deadline(room) for room in peer.rooms), default=self._now)
        drift = self.timing.clock_drift
        release_at = self._now + max(0.0, latest - self._now) * (1 + drift) / (1 - drift) + self.timing.quarantine_s
        previous = self._fenced.get(peer.peer_id)
        if previous is not None and previous.release_at > self._now:
            incarnation = max(incarnation, previous.incarnation)
            release_at = max(release_at, previous.release_at)
        self._fenced[peer.peer_id] = FenceRecord(incarnation, release_at)

    def _release_fences(self) -> None:
        """Forget the fences no room of which can still be written."""
        for peer_id in [p for p, fence in self._fenced.items() if fence.release_at <= self._now]:
            del self._fenced[peer_id]

    def _credit_own_stall(self, late: float) -> None:
        """R8 counts a peer's silence only while this endpoint ran. A heartbeat tick more than a heartbeat period
        late means this endpoint (its thread, its process, or its whole machine) did not run for that long and heard
        nobody: that time is not the peers' silence, so each peer's last-heard time moves on by it (never past now).
        A peer that is really gone is then declared dead that much later, which only delays the release of what it
        held (later is the safe side for every quarantine); a live peer whose frames were waiting is heard first."""
        if late <= self.timing.heartbeat_s:
            return
        self.stats.own_stalls += 1
        for peer in self._peers.values():
            peer.last_heard = min(self._now, peer.last_heard + late)

    def _check_liveness(self) -> None:
        """R8: a peer silent past `_dead_after_s()` is dead; with rooms it is fenced, in any case it is pruned."""
        self._release_fences()
        deadline = self._now - self._dead_after_s()
        for peer in [p for p in self._peers.values() if p.last_heard < deadline]:
            if peer.rooms:
                self.stats.peers_dead += 1
                self._fence(peer, reasons.PEER_DEAD)
            del self._peers[peer.peer_id]

    # ---- event handlers ---------------------------------------------------------------------------------------
    def _on_frame(self, event: ReceivedFrame) -> None:
        try:
            envelope = self.codec.decode(event.frame)
        except ProtocolError:
            self.stats.frames_rejected += 1
            return
        self._on_received(Received(envelope))

    def _on_received(self, event: Received) -> None:
        envelope = event.envelope  # decoded by a Codec, which refuses every other protocol version
        if isinstance(envelope.body, Fenced):
            self._on_fenced(envelope.sender, envelope.body)  # about our own incarnation: no admission needed
            return
        peer = self._admit(envelope)
        if peer is None:
            return
        self._on_heard(peer, envelope)
        body = envelope.body
        handler = self._body_handlers.get(type(body))
        if handler is None:
            if not isinstance(body, Heartbeat):
                self.stats.reject(f"unexpected {type(body).__name__} at {self.ROLE}")
            return
        handler(peer, body)

    def epoch_towards(self, peer_id: str) -> int:
        """Our epoch towards `peer_id` (the second half of our incarnation on envelopes to it)."""
        return int(self._epochs.get(peer_id, 0))

    def _on_fenced(self, peer_id: str, body: Fenced) -> None:
        """The peer declared our incarnation towards it dead: lose our rooms with it, start a new epoch.

        Handled even when we have fenced that peer ourselves (two sides of a healed partition), otherwise neither
        side would ever start a new epoch."""
        epoch = self.epoch_towards(peer_id)
        if (body.session, body.epoch) != (self.session, epoch):
            self.stats.stale_dropped += 1
            return
        self._epochs.remember(peer_id, epoch + 1)
        peer = self._peers.get(peer_id)
        if peer is not None:
            for room in list(peer.rooms):
                self._peer_lost(peer, room, reasons.FENCED_BY_PEER)
        self._send(peer_id, Heartbeat())

    def _on_completion(self, event: Completion) -> None:
        self._on_token(event.token, event.ok, event.reason, event.peer_gone)

    def _on_send_failed(self, event: SendFailed) -> None:
        self.stats.sends_failed += 1
        body = event.envelope.body
        if isinstance(body, RoomBody):
            self._fail_by_id(body.room, event.peer, reasons.SEND_FAILED)

    def _on_tick(self, event: Tick) -> None:
        now = self._now
        for peer_id, body in self._retrier.pop_due(now):
            self.stats.retries += 1
            self._send(peer_id, body)
        for when, room in self._deadlines.pop_due(now):
            self._on_deadline(when, room)
        if self._next_heartbeat is not None and now >= self._next_heartbeat:
            self._credit_own_stall(now - self._next_heartbeat)
            self._check_liveness()
            for peer_id in self._peers:
                self._send(peer_id, Heartbeat())
            self._next_heartbeat = now + self.timing.heartbeat_s if self._peers else None

    # ---- deadlines --------------------------------------------------------------------------------------------
    @abstractmethod
    def _deadline_live(self, when: float, room: int) -> bool:
        """subclass: whether the alarm (when, room) still matters (stale ones are purged lazily)."""

    def _next_deadline(self) -> float | None:
        while (head := self._deadlines.peek()) is not None:
            if self._deadline_live(*head):
                return head[0]
            self._deadlines.discard_head()
        return None
