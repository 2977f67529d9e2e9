"""What a runtime agent knows of its peers, and the frames to or from one it cannot verify yet.

Owns `PeerLinks`, the base of `BaseAgent` (agent.py): the peers' bootstrap records (by peer id and by control
address), the peers found incompatible (`check_peer`), the sends parked for peers not resolved yet and the
inbound frames held from senders not verified yet (two `ParkedSends`, outbox.py, each bounded by
`AgentConfig.park`). It checks every inbound frame's sender before the endpoint sees it (`_verified`), sends or
parks every outbound envelope (`_send`), takes in each record the resolver delivers (`_on_record`) and releases
the peers that left (`_release_departed`). All of it runs on the reactor; the state lives on the agent
itself (`agent._records`, ...), so the subclasses and tests read it there.

Invariants:
- per-peer state goes when the peer goes: once the endpoint no longer tracks a peer (it fell silent past
  `Timing.dead_after_s`: closed, killed or a stranger), the agent releases its record, its control socket, its
  resolver entry, its parked sends and the subclass's state for it (`_release_departed`). What the agent keeps is
  bounded by the peers alive now, never by all the peers it has seen;
- a stranger never changes a room: only a frame whose sender's bootstrap record the agent holds, and whose session
  is that record's, reaches the endpoint (`_verified`). A frame from a sender not resolved yet, or from a session
  newer than its record (a restart the resolver has not seen yet), is held until the record arrives, bounded as
  the parked sends are (`AgentConfig.park`); one from an older session, or from a sender no record names in time,
  is dropped and counted in `kvstage_rejected_frames` (docs/security.md, "Who may talk to a room");
- a frame is decoded only once its sender is verified: until then it is its bytes and its head (`InboundFrame`,
  read by `Codec.peek`), so what a frame costs while it waits is what it weighs on the wire (plus
  `HELD_OVERHEAD`), never its decoded objects, several times that;
- every send either goes to the control channel, is parked, or comes back to the endpoint as `SendFailed`; a
  parked send that will never go comes back the same way, with its reason; an older session's record never
  replaces a newer one's.

Called by agent.py (`BaseAgent` is a `PeerLinks`; its loop dispatches records and frames here); decode.py and
prefill.py override the hooks `_peer_changed` and `_peer_fenced`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from kvstage.errors import ConfigError, ProtocolError, TransportError
from kvstage.protocol import Codec, DecodeEndpoint, PrefillEndpoint, Received, SendFailed
from kvstage.protocol.codec import FrameHead
from kvstage.protocol.messages import Envelope, Metadata, RoomBody
from kvstage.runtime.config import AgentConfig, check_peer
from kvstage.runtime.directory import Resolver
from kvstage.runtime.metrics import AgentMetrics
from kvstage.runtime.outbox import (
    INCOMPATIBLE_SENDER,
    NOT_PARKED,
    SESSION_ENDED,
    STALE_SESSION,
    UNREGISTERED,
    UNVERIFIED,
    ParkedSends,
    ParkLimits,
)
from kvstage.runtime.trace import ChunkTrace
from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.control import ControlChannel

log = logging.getLogger(__name__)

#: Bytes a held frame is counted for beyond its own: the objects that hold it (its head, the entry of its queue).
HELD_OVERHEAD: Final = 256
#: Why a verified frame that `peek` read still did not decode (`kvstage_rejected_frames{reason}`).
UNDECODABLE = "undecodable"


@dataclass(frozen=True, slots=True)
class InboundFrame:
    """A frame the control channel read (and authenticated), of which only the head is decoded (`Codec.peek`)."""

    frame: bytes
    head: FrameHead

    @property
    def nbytes(self) -> int:
        """What it weighs while it waits: its bytes and the objects that hold them."""
        return len(self.frame) + HELD_OVERHEAD


class PeerLinks(ABC):
    """The agent's peer tables and the checks and sends that use them; see the module docstring."""

    role: ClassVar[str]  # set by each side's agent (decode.py, prefill.py)
    peer_role: ClassVar[str]
    # set by BaseAgent (agent.py): in its __init__, and the endpoint, channel and resolver in its start()
    config: AgentConfig
    peer_id: str
    metrics: AgentMetrics
    trace: ChunkTrace
    endpoint: DecodeEndpoint | PrefillEndpoint
    channel: ControlChannel[Envelope, InboundFrame]
    resolver: Resolver
    _codec: Codec

    def __init__(self, park: ParkLimits) -> None:
        self._records: dict[str, PeerRecord] = {}
        self._peer_of_address: dict[str, str] = {}
        self._parked: ParkedSends[Envelope] = ParkedSends(park)
        self._held: ParkedSends[InboundFrame] = ParkedSends(park)  # frames of senders not verified yet, per sender
        self._incompatible: dict[str, str] = {}

    @abstractmethod
    def _feed(self, event: Any) -> None:
        """Hand one event to the endpoint and carry out its actions (agent.py)."""

    # ---- subclass hooks ----------------------------------------------------------------------------------

    def _peer_changed(self, old: PeerRecord | None, record: PeerRecord) -> None:
        """A peer registered (or re-registered with a new session)."""

    def _peer_fenced(self, peer: str) -> None:
        """The endpoint declared `peer`'s incarnation dead or replaced, or the peer's session ended."""

    # ---- inbound: who may reach the endpoint --------------------------------------------------------------

    def _on_frame(self, inbound: InboundFrame) -> None:
        """A frame from the control channel: decoded and handed to the endpoint once its sender is verified."""
        if self._verified(inbound):
            self._feed_frame(inbound)

    def _feed_frame(self, inbound: InboundFrame) -> None:
        try:
            envelope = self._codec.decode(inbound.frame)
        except ProtocolError as exc:
            log.debug("%s: a frame of %r does not decode: %s", self.peer_id, inbound.head.sender, exc)
            self.metrics.frame_rejected(UNDECODABLE)
            return
        self.trace.message(envelope.body, "in", envelope.sender)
        self._feed(Received(envelope))

    def _verified(self, inbound: InboundFrame) -> bool:
        """Whether the frame may reach the endpoint: the agent holds its sender's record, of the same session.
        Otherwise the frame is held, undecoded, until the record arrives (sender not resolved yet, or a newer
        session: a restart), or dropped and counted (an older session, an incompatible peer, or the holding caps)."""
        sender, session = inbound.head.sender, inbound.head.session
        record = self._records.get(sender)
        if record is not None and session == record.session:
            return True
        if sender in self._incompatible or (record is not None and session < record.session):
            self.metrics.frame_rejected(INCOMPATIBLE_SENDER if sender in self._incompatible else STALE_SESSION)
            return False
        # ask once per holding, not per frame; but again if the resolver let the sender go meanwhile (strangers
        # asking about more peers than it keeps evict the entry asked about longest ago), else a peer whose first
        # frame came amid strangers' would wait, its frames held, until they expire
        asked = (self._held.holds(sender) and self.resolver.wants(sender)) or self.resolver.want(sender)
        if not asked:
            self.metrics.frame_rejected(f"{UNVERIFIED}: too many unresolved peers")
            return False
        for _, _, reason in self._held.park(sender, inbound, inbound.nbytes, time.monotonic()):
            self.metrics.frame_rejected(f"{UNVERIFIED}: {reason}")
        return False

    def _release_held(self, record: PeerRecord) -> None:
        """`record` arrived: the frames held from its sender go to the endpoint if they are of its session."""
        for inbound in self._held.pop(record.peer_id):
            session = inbound.head.session
            if session == record.session:
                self._feed_frame(inbound)
            else:
                self.metrics.frame_rejected(STALE_SESSION if session < record.session else UNREGISTERED)

    # ---- outbound: send, park or fail ---------------------------------------------------------------------

    def _send(self, peer: str, envelope: Envelope) -> None:
        record = self._records.get(peer)
        if record is None:
            self._park_send(peer, envelope)
            return
        try:
            self.channel.send(record.control_address, envelope)
        except TransportError as exc:
            self._feed(SendFailed(peer, envelope, str(exc)))

    def _park_send(self, peer: str, envelope: Envelope) -> None:
        if peer in self._incompatible:
            self._feed(SendFailed(peer, envelope, self._incompatible[peer]))
            return
        if not self.resolver.want(peer):
            self._feed(SendFailed(peer, envelope, "too many unresolved peers"))
            return
        if not isinstance(envelope.body, RoomBody):  # a heartbeat or Fenced: the next one goes once it resolves
            self._send_failed(peer, envelope, NOT_PARKED)
            return
        nbytes = len(self._codec.encode(envelope))
        pinned = isinstance(envelope.body, Metadata)  # decode sends it for a room its engine admitted, never a reply
        for failed in self._parked.park(peer, envelope, nbytes, time.monotonic(), pinned):
            self._send_failed(*failed)

    def _send_failed(self, peer: str, envelope: Envelope, reason: str) -> None:
        self.metrics.parked_send_failed(reason)
        self._feed(SendFailed(peer, envelope, reason))

    # ---- records in, peers out -----------------------------------------------------------------------------

    def _release_departed(self, now: float) -> None:
        """Release every peer the endpoint no longer tracks, and fail the sends parked past their time."""
        live = self.endpoint.peers()
        for peer in (self._records.keys() | self._incompatible.keys()) - live:
            self._release_peer(peer)
        for failed in self._parked.expire(now):
            self._send_failed(*failed)
        for _, _, reason in self._held.expire(now):
            self.metrics.frame_rejected(f"{UNVERIFIED}: {reason}")
        for table, count in (("records", len(self._records)), ("sockets", self.channel.open_peers),
                             ("resolver", self.resolver.wanted()), ("parked", len(self._parked)),
                             ("held", len(self._held.peers())), ("endpoint", len(live))):  # fmt: skip
            self.metrics.set_peer_state(table, count)

    def _release_peer(self, peer: str) -> None:
        """`peer`'s session ended: drop its record, control socket, resolver entry, parked sends and the
        subclass's state for it. A later message from it starts over (resolved again)."""
        record = self._records.pop(peer, None)
        if record is not None:
            self._forget_address(peer, record.control_address)
        self._incompatible.pop(peer, None)
        self.resolver.forget(peer)
        self._peer_fenced(peer)
        for envelope in self._parked.pop(peer):
            self._send_failed(peer, envelope, SESSION_ENDED)
        for _ in self._held.pop(peer):
            self.metrics.frame_rejected(f"{UNVERIFIED}: {SESSION_ENDED}")

    def _forget_address(self, peer: str, address: str) -> None:
        """`peer` no longer lives at `address`: close the socket there, unless another peer (one that took the
        address over, e.g. a new instance on the same port) lives there now."""
        if self._peer_of_address.get(address) not in (peer, None):
            return
        self._peer_of_address.pop(address, None)
        self.channel.forget_peer(address)

    def _on_record(self, record: PeerRecord) -> None:
        try:
            check_peer(self.config, self.role, self.peer_role, record)
        except ConfigError as exc:
            log.error("%s: %s", self.peer_id, exc)
            self._incompatible[record.peer_id] = str(exc)
            for envelope in self._parked.pop(record.peer_id):
                self._feed(SendFailed(record.peer_id, envelope, str(exc)))
            for _ in self._held.pop(record.peer_id):
                self.metrics.frame_rejected(INCOMPATIBLE_SENDER)
            return
        old = self._records.get(record.peer_id)
        if old is not None and record.session < old.session:
            # a lookup that raced a restart: the bootstrap never lets an older session replace a newer one, nor here
            log.info("%s: ignored session %d of %r, which runs session %d", self.peer_id, record.session,
                     record.peer_id, old.session)  # fmt: skip
            return
        if old is not None and old.control_address != record.control_address:
            self._forget_address(record.peer_id, old.control_address)
        self._records[record.peer_id] = record
        self._peer_of_address[record.control_address] = record.peer_id
        self._peer_changed(old, record)
        self._release_held(record)
        for envelope in self._parked.pop(record.peer_id):
            self._send(record.peer_id, envelope)
