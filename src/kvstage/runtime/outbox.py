"""Messages parked for peers the agent cannot verify yet: bounded in peers, messages per peer, bytes and time.

Owns `ParkLimits` and `ParkedSends`, and the reasons an inbound frame is dropped for its sender. An agent can only
send to a peer whose bootstrap record it holds (the record names the peer's control address). Until the resolver
delivers that record, the agent parks the peer's sends here; when the record arrives it pops them in order and
sends them. The same bookkeeping, in a second instance with the same caps, holds the frames received from such a
peer (or from a session newer than its record) until the record arrives: only then may they reach the endpoint.

Invariants:
- what is parked never exceeds `max_peers` peers, `max_per_peer` envelopes per peer, `max_bytes` encoded bytes
  in all, nor `ttl_s` seconds: `expire` hands back every envelope older than that;
- a new peer over the peer cap, or a send over the byte cap, evicts the peers whose oldest envelope is the
  oldest (a stranger that stopped talking never locks a newcomer out), except peers holding a send parked as
  `pinned` (the agent pins what its own engine asked for, never a reply a sender provoked: strangers cannot evict
  a room's Metadata); when nothing can be evicted, or the send is over its own peer's cap, it is refused;
- every envelope that leaves other than for sending (expired, evicted, dropped with its peer) is handed back
  to the caller, which reports it as a failed send: nothing disappears silently.

Pure bookkeeping on the reactor (no locks, no I/O, the caller passes `now`). Called by runtime/peers.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstage.errors import ConfigError

#: What is parked: an outbound `Envelope`, or an inbound frame held undecoded (runtime/peers.py).
T = TypeVar("T")

#: Refusal reasons (the SendFailed reason the agent reports).
PEER_QUEUE_FULL = "peer not resolved and its parked sends are full"
FULL = "parked sends full (peers or bytes) of sends that cannot be evicted"
EXPIRED = "peer not resolved in time"
EVICTED = "evicted by younger parked sends"


#: (peer, message, reason) of a parked message that will not go on.
Failed = tuple[str, T, str]


#: The reason a send parked for a peer whose session ended fails with.
SESSION_ENDED = "peer session ended"

#: Why an inbound frame never reached the endpoint (`kvstage_rejected_frames{reason}`), besides the parking caps'
#: reasons above, which a held frame's reason names after `UNVERIFIED`.
UNVERIFIED = "sender not verified"
STALE_SESSION = "session older than the sender's record"
UNREGISTERED = "session not the sender's registered one"
INCOMPATIBLE_SENDER = "sender incompatible with this agent"
#: The reason a heartbeat or Fenced to an unresolved peer fails with: only room messages are parked (the others
#: repeat on their own), so strangers that keep talking park nothing but the room replies they provoke.
NOT_PARKED = "peer not resolved (not parked: no room)"


@dataclass(frozen=True, slots=True)
class ParkLimits:
    """Caps of the sends parked for unresolved peers (`AgentConfig.park`)."""

    max_peers: int = 256
    max_per_peer: int = 1024
    max_bytes: int = 64 * 2**20
    ttl_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_peers", "max_per_peer", "max_bytes", "ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ParkLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class _Parked(Generic[T]):
    since: float
    envelope: T
    nbytes: int
    pinned: bool


class ParkedSends(Generic[T]):
    """Messages waiting for their peer's record, per peer in arrival order."""

    def __init__(self, limits: ParkLimits) -> None:
        self.limits = limits
        self._queues: dict[str, deque[_Parked[T]]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def peers(self) -> frozenset[str]:
        return frozenset(self._queues)

    def holds(self, peer: str) -> bool:
        """Whether anything is parked for `peer`."""
        return peer in self._queues

    def park(self, peer: str, envelope: T, nbytes: int, now: float, pinned: bool = False) -> list[Failed[T]]:
        """Park `envelope` (`nbytes` encoded) for `peer`. Returns what failed: this envelope if a cap refused it,
        or the envelopes of the peers it evicted. A `pinned` send keeps its peer from being evicted."""
        queue = self._queues.get(peer)
        if queue is not None and len(queue) >= self.limits.max_per_peer:
            return [(peer, envelope, PEER_QUEUE_FULL)]
        failed: list[Failed[T]] = []
        while self._bytes + nbytes > self.limits.max_bytes or (
            queue is None and len(self._queues) >= self.limits.max_peers
        ):
            others = [p for p in self._queues if p != peer and not any(item.pinned for item in self._queues[p])]
            if not others:
                return [*failed, (peer, envelope, FULL)]
            victim = min(others, key=lambda p: self._queues[p][0].since)
            failed += [(victim, old, EVICTED) for old in self.pop(victim)]
        if queue is None:
            queue = self._queues[peer] = deque()
        queue.append(_Parked(now, envelope, nbytes, pinned))
        self._bytes += nbytes
        return failed

    def pop(self, peer: str) -> list[T]:
        """Every envelope parked for `peer`, oldest first; the peer leaves the table (its record arrived, or its
        session ended)."""
        queue = self._queues.pop(peer, None)
        if queue is None:
            return []
        self._bytes -= sum(item.nbytes for item in queue)
        return [item.envelope for item in queue]

    def expire(self, now: float) -> list[Failed[T]]:
        """Take back every envelope parked for longer than `ttl_s`."""
        cutoff = now - self.limits.ttl_s
        out: list[Failed[T]] = []
        for peer in [p for p, queue in self._queues.items() if queue[0].since <= cutoff]:
            queue = self._queues[peer]
            while queue and queue[0].since <= cutoff:
                item = queue.popleft()
                self._bytes -= item.nbytes
                out.append((peer, item.envelope, EXPIRED))
            if not queue:
                del self._queues[peer]
        return out
