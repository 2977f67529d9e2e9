"""What strangers can do to a real decode agent through its control socket, and what they cannot (issue #15,
defects 1-3). A stranger is a sender id no bootstrap record names: the agent cannot address its replies, so it
parks them; that state must be bounded in count, bytes and time, pruned, and never touch a room."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
from deployment import PATIENT, Caps, Deployment, Stranger, prefill_instance, start_room, wait_outcomes

from kvstage.protocol import Limits
from kvstage.protocol.messages import PROTOCOL_VERSION, Abort, Heartbeat, StagingRequest
from kvstage.runtime.outbox import ParkLimits


def _wait(done: Callable[[], bool], what: str, state: Callable[[], object] = lambda: "", timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen after {timeout}s {state()}")
        time.sleep(0.02)


def _handled(deployment: Deployment, frames: int) -> Callable[[], bool]:
    """True once decode received `frames` frames and its agent thread has handled every one of them."""
    agent = deployment.decode
    return lambda: agent.channel.received >= frames and agent._inbox == 0


def _serve_room(deployment: Deployment, room: int, instance: str) -> None:
    """A new prefill instance serves `room` (already expected on decode); every side must succeed."""
    prefill = prefill_instance(instance, deployment.bootstrap.address, deployment.caps)
    try:
        for agent in prefill:
            start_room(agent, room)
        outcomes = [wait_outcomes(deployment.decode, [room])[room]] + [wait_outcomes(a, [room])[room] for a in prefill]
        assert all(o.ok for o in outcomes), outcomes
    finally:
        for agent in prefill:
            agent.close()


def test_a_stranger_naming_an_open_room_in_a_thousand_aborts_never_fails_that_room() -> None:
    deployment = Deployment(Caps(timing=PATIENT))
    stranger = Stranger(deployment.decode.channel.address)
    try:
        deployment.expect(7, "P")  # room 7 is open; its prefill instance is not up yet
        for _ in range(1100):  # more than a peer's parked sends may hold: replies to the stranger overflow
            stranger.send("evil/0", Abort(room=7, reason="aborted by prefill"))
        _wait(_handled(deployment, 1100), "decode handled the stranger's 1,100 aborts")
        assert deployment.decode.poll() == [], "a reply to a peer with no part in room 7 changed room 7"
        assert deployment.decode.metrics.value("kvstage_parked_sends_failed_total", reason="peer not resolved and "
                                               "its parked sends are full") > 0  # fmt: skip
        _serve_room(deployment, 7, "P")
    finally:
        stranger.close()
        deployment.close()


def test_strangers_that_named_themselves_once_never_lock_a_new_prefill_instance_out() -> None:
    caps = Caps(limits=Limits(max_peers=64), park=ParkLimits(ttl_s=2.0))
    deployment = Deployment(caps)
    stranger = Stranger(deployment.decode.channel.address)
    try:
        for i in range(64):  # as many strangers as the agent tracks peers, one heartbeat each
            stranger.send(f"ghost-{i}/0", Heartbeat())
        _wait(_handled(deployment, 64), "decode handled one heartbeat of each stranger")
        assert deployment.tables()["endpoint"] == 64
        _wait(lambda: not any(deployment.tables().values()), "every per-peer table emptied once the strangers fell "
              "silent", deployment.tables)  # fmt: skip
        deployment.expect(1, "P")
        _serve_room(deployment, 1, "P")
    finally:
        stranger.close()
        deployment.close()


def test_replies_parked_for_talking_strangers_stay_within_their_caps_and_go_when_the_strangers_stop() -> None:
    caps = Caps(park=ParkLimits(max_peers=8, max_per_peer=16, max_bytes=4096, ttl_s=1.0))
    deployment = Deployment(caps)
    stranger = Stranger(deployment.decode.channel.address)
    prefill = prefill_instance("P", deployment.bootstrap.address, caps)
    try:
        most, sent, room = 0, 0, 0
        until = time.monotonic() + 2.5
        while time.monotonic() < until:  # 20 strangers keep talking while rooms run; their aborts (of the live room
            for i in range(20):  # too) provoke room replies, which are parked
                stranger.send(f"chatty-{i}/0", Heartbeat())
                stranger.send(f"chatty-{i}/0", Abort(room=room + i % 2, reason="aborted by prefill"))
            sent += 40
            parked = deployment.decode._parked
            most = max(most, len(parked))
            assert len(parked) <= 8 * 16 and parked.nbytes <= 4096 and len(parked.peers()) <= 8
            if sent % 800 == 0:
                room += 1
                outcomes = deployment.run_room(room, "P", prefill)
                assert all(o.ok for o in outcomes), outcomes
        assert most > 0 and room > 0, "the strangers' replies were parked, and rooms ran meanwhile"
        _wait(_handled(deployment, sent), "decode handled every stranger frame")
        _wait(lambda: deployment.tables() == {"records": 2, "sockets": 2, "resolver": 2, "parked": 0, "endpoint": 2},
              "only the live prefill instance is left in the tables", deployment.tables)  # fmt: skip
    finally:
        for agent in prefill:
            agent.close()
        stranger.close()
        deployment.close()


def test_chunk_indices_beyond_the_room_or_the_wire_bound_grow_nothing_and_leave_the_room_alone() -> None:
    """sglang #39764: one unchecked chunk index from the wire grew a list without bound. Here an index past the
    wire bound is refused by the codec, one within it but past the room's chunks by the endpoint, and the room
    (whose writer the sender claims to be) goes on to succeed."""
    deployment = Deployment(Caps(timing=PATIENT))
    writer = Stranger(deployment.decode.channel.address)
    try:
        deployment.expect(5, "P")
        for chunk in (2**16 - 1, 40_000):
            writer.send("P/0", StagingRequest(room=5, chunk=chunk))
        for seq, chunk in enumerate((2**16, 2**63 - 1)):  # built by hand: the codec refuses to encode them
            writer.send_raw(msgspec.msgpack.encode([PROTOCOL_VERSION, "P/0", 1, 0, 10 + seq, None,
                                                    ["stage_req", 5, chunk]]))  # fmt: skip
        channel = deployment.decode.channel
        _wait(lambda: channel.received + channel.rejected["undecodable"] == 4, "all four frames handled")
        assert channel.rejected["undecodable"] == 2, "indices past the wire bound never decode"
        refused = lambda: deployment.decode.metrics.value("kvstage_protocol_rejected", why="chunk index out of range")  # noqa: E731
        _wait(lambda: refused() == 2, "indices past the room's chunks refused by the endpoint")
        assert deployment.decode.poll() == []
        _serve_room(deployment, 5, "P")
    finally:
        writer.close()
        deployment.close()
