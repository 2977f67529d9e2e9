"""`ParkedSends`: what is parked for unresolved peers stays within its caps, leaves in time, and an engine's own
send (pinned) is never evicted by replies strangers provoked."""

from __future__ import annotations

from kvstage.protocol.messages import PROTOCOL_VERSION, AbortAck, Body, Envelope, Heartbeat
from kvstage.runtime.outbox import EVICTED, EXPIRED, FULL, PEER_QUEUE_FULL, ParkedSends, ParkLimits


def _env(body: Body) -> Envelope:
    return Envelope(PROTOCOL_VERSION, "D/0", 1, 0, 1, None, body)


def test_a_peer_over_its_own_cap_is_refused_and_a_new_peer_evicts_the_longest_waiting_one() -> None:
    parked = ParkedSends(ParkLimits(max_peers=2, max_per_peer=2, max_bytes=1000, ttl_s=5))
    assert parked.park("a", _env(AbortAck(room=1)), 10, now=0.0) == []
    assert parked.park("a", _env(AbortAck(room=2)), 10, now=0.1) == []
    refused = parked.park("a", _env(AbortAck(room=3)), 10, now=0.2)
    assert [(peer, reason) for peer, _, reason in refused] == [("a", PEER_QUEUE_FULL)]
    assert parked.park("b", _env(AbortAck(room=4)), 10, now=0.3) == []
    evicted = parked.park("c", _env(AbortAck(room=5)), 10, now=0.4)
    assert [(peer, reason) for peer, _, reason in evicted] == [("a", EVICTED), ("a", EVICTED)]
    assert parked.peers() == {"b", "c"} and len(parked) == 2 and parked.nbytes == 20


def test_bytes_are_capped_and_pinned_sends_are_never_evicted() -> None:
    parked = ParkedSends(ParkLimits(max_peers=8, max_per_peer=8, max_bytes=100, ttl_s=5))
    assert parked.park("engine", _env(AbortAck(room=1)), 60, now=0.0, pinned=True) == []
    refused = parked.park("stranger", _env(AbortAck(room=2)), 60, now=1.0)
    assert [(peer, reason) for peer, _, reason in refused] == [("stranger", FULL)]
    assert parked.peers() == {"engine"} and parked.nbytes == 60


def test_sends_parked_past_their_time_come_back_and_the_peer_leaves() -> None:
    parked = ParkedSends(ParkLimits(ttl_s=1.0))
    parked.park("a", _env(Heartbeat()), 10, now=0.0)
    parked.park("a", _env(AbortAck(room=1)), 10, now=0.9)
    assert [reason for _, _, reason in parked.expire(now=1.5)] == [EXPIRED]
    assert parked.peers() == {"a"}
    assert len(parked.expire(now=2.0)) == 1 and not parked.peers() and parked.nbytes == 0
