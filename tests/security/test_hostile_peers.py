"""What strangers can do to real agents through their control sockets, and what they cannot (issue #15, defects
1-3, and the review after it). A stranger is a sender id no bootstrap record names, or a frame whose session is not
the one its sender's record names. Its frames never reach the endpoint: the agent holds them until the sender's
record arrives (bounded in count, bytes and time, and pruned), and drops them if the record never names them. So a
stranger never changes a room, never fills a table a legitimate peer needs, and what it costs goes when it stops.
Without a secret (as here) anyone who can reach the port may claim a registered peer's id and session: that is a
member, which docs/security.md leaves out of the threat model; with one, such frames fail authentication."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest
from deployment import PATIENT, Caps, Deployment, prefill_instance, start_room, wait_outcomes

from kvstage.e2e.stranger import Stranger
from kvstage.protocol import Limits
from kvstage.protocol.messages import PROTOCOL_VERSION, Abort, Heartbeat, Metadata, StagingRequest
from kvstage.runtime import DecodeAgent, PrefillAgent, RoomOutcome
from kvstage.runtime.agent import AgentTask
from kvstage.runtime.outbox import PEER_QUEUE_FULL, STALE_SESSION, UNREGISTERED, UNVERIFIED, ParkLimits


def _wait(done: Callable[[], bool], what: str, state: Callable[[], object] = lambda: "", timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen after {timeout}s {state()}")
        time.sleep(0.02)


def _handled(deployment: Deployment, frames: int) -> Callable[[], bool]:
    """True once decode received `frames` frames and its reactor has handled every one of them (the channel counts a
    frame once it was handed over)."""
    agent = deployment.decode
    return lambda: agent.channel.received >= frames


def _rejected(agent: DecodeAgent, reason: str) -> float:
    return agent.metrics.value("kvstage_rejected_frames_total", reason=reason)


def _serve(deployment: Deployment, room: int, prefill: list[PrefillAgent]) -> None:
    """`prefill` serves `room` (already expected on decode); every side must succeed."""
    for agent in prefill:
        start_room(agent, room)
    outcomes = [wait_outcomes(deployment.decode, [room])[room]] + [wait_outcomes(a, [room])[room] for a in prefill]
    assert all(o.ok for o in outcomes), outcomes


def _serve_room(deployment: Deployment, room: int, instance: str) -> None:
    """A new prefill instance serves `room` (already expected on decode); every side must succeed."""
    prefill = prefill_instance(instance, deployment.bootstrap.address, deployment.caps)
    try:
        _serve(deployment, room, prefill)
    finally:
        for agent in prefill:
            agent.close()


def test_a_stranger_naming_an_open_room_in_a_thousand_aborts_never_fails_that_room() -> None:
    deployment = Deployment(Caps(timing=PATIENT))
    stranger = Stranger(deployment.decode.channel.address)
    try:
        deployment.expect(7, "P")  # room 7 is open; its prefill instance is not up yet
        for _ in range(1100):  # more than the agent holds for one unverified sender: the rest are dropped
            stranger.send("evil/0", Abort(room=7, reason="aborted by prefill"))
        _wait(_handled(deployment, 1100), "decode handled the stranger's 1,100 aborts")
        assert deployment.decode.poll() == [], "a stranger's abort changed room 7"
        assert deployment.tables()["endpoint"] == 2, "the endpoint knows only room 7's writers, never the stranger"
        assert _rejected(deployment.decode, f"{UNVERIFIED}: {PEER_QUEUE_FULL}") == 1100 - ParkLimits().max_per_peer
        _serve_room(deployment, 7, "P")
    finally:
        stranger.close()
        deployment.close()


def test_strangers_that_named_themselves_once_never_lock_a_new_prefill_instance_out() -> None:
    caps = Caps(timing=PATIENT, limits=Limits(max_peers=64), park=ParkLimits(ttl_s=2.0))
    deployment = Deployment(caps)
    stranger = Stranger(deployment.decode.channel.address)
    try:
        for i in range(64):  # as many strangers as the agent tracks peers, one heartbeat each
            stranger.send(f"ghost-{i}/0", Heartbeat())
        _wait(_handled(deployment, 64), "decode handled one heartbeat of each stranger")
        assert deployment.tables()["held"] == 64 and deployment.tables()["endpoint"] == 0
        _wait(lambda: not any(deployment.tables().values()), "every per-peer table emptied once the strangers fell "
              "silent", deployment.tables)  # fmt: skip
        deployment.expect(1, "P")
        _serve_room(deployment, 1, "P")
    finally:
        stranger.close()
        deployment.close()


def test_frames_held_from_talking_strangers_stay_within_their_caps_and_go_when_the_strangers_stop() -> None:
    caps = Caps(timing=PATIENT, park=ParkLimits(max_peers=8, max_per_peer=16, max_bytes=4096, ttl_s=1.0))
    deployment = Deployment(caps)
    stranger = Stranger(deployment.decode.channel.address)
    prefill = prefill_instance("P", deployment.bootstrap.address, caps)
    try:
        most, sent, room = 0, 0, 0
        until = time.monotonic() + 2.5
        while time.monotonic() < until:  # 20 strangers keep talking while rooms run; their frames (aborts of the
            for i in range(20):  # live room too) are held until their records arrive, which never happens
                stranger.send(f"chatty-{i}/0", Heartbeat())
                stranger.send(f"chatty-{i}/0", Abort(room=room + i % 2, reason="aborted by prefill"))
            sent += 40
            held = deployment.decode._held
            most = max(most, len(held))
            assert len(held) <= 8 * 16 and held.nbytes <= 4096 and len(held.peers()) <= 8
            if sent % 800 == 0:
                room += 1
                outcomes = deployment.run_room(room, "P", prefill)
                assert all(o.ok for o in outcomes), outcomes
        assert most > 0 and room > 0, "the strangers' frames were held, and rooms ran meanwhile"
        _wait(_handled(deployment, sent), "decode handled every stranger frame")
        _wait(lambda: deployment.tables() == {"records": 2, "sockets": 2, "resolver": 2, "parked": 0, "held": 0,
                                              "endpoint": 2},
              "only the live prefill instance is left in the tables", deployment.tables)  # fmt: skip
    finally:
        for agent in prefill:
            agent.close()
        stranger.close()
        deployment.close()


def test_chunk_indices_beyond_the_room_or_the_wire_bound_grow_nothing_and_leave_the_room_alone() -> None:
    """sglang #39764: one unchecked chunk index from the wire grew a list without bound. Here the room's own writer
    (its id and session, as a member could forge them without a secret) sends them: an index past the wire bound is
    refused by the codec, one within it but past the room's chunks by the endpoint, and the room goes on to
    succeed."""
    deployment = Deployment(Caps(timing=PATIENT))
    prefill = prefill_instance("P", deployment.bootstrap.address, deployment.caps)
    writer = Stranger(deployment.decode.channel.address)
    try:
        deployment.expect(5, "P")
        _wait(lambda: "P/0" in deployment.decode._records, "decode resolved the room's writers")
        session = prefill[0].session
        for chunk in (2**16 - 1, 40_000):
            writer.send("P/0", StagingRequest(room=5, chunk=chunk), session=session)
        for seq, chunk in enumerate((2**16, 2**63 - 1)):  # built by hand: the codec refuses to encode them
            writer.send_raw(msgspec.msgpack.encode([PROTOCOL_VERSION, "P/0", session, 0, 10 + seq, None,
                                                    ["stage_req", 5, chunk]]))  # fmt: skip
        undecodable = lambda: deployment.decode.metrics.value("kvstage_rejected_frames_total", reason="undecodable")  # noqa: E731
        _wait(lambda: undecodable() == 2, "indices past the wire bound never decode")
        refused = lambda: deployment.decode.metrics.value("kvstage_protocol_rejected", why="chunk index out of range")  # noqa: E731
        _wait(lambda: refused() == 2, "indices past the room's chunks refused by the endpoint")
        assert deployment.decode.poll() == []
        _serve(deployment, 5, prefill)
    finally:
        for agent in prefill:
            agent.close()
        writer.close()
        deployment.close()


@contextmanager
def _strangers_at_prefill(caps: Caps) -> Iterator[tuple[Deployment, list[PrefillAgent], list[Stranger]]]:
    """A deployment, a prefill instance "P" serving it, and a stranger at each prefill rank's control socket."""
    deployment = Deployment(caps)
    prefill = prefill_instance("P", deployment.bootstrap.address, caps)
    strangers = [Stranger(agent.channel.address) for agent in prefill]
    try:
        yield deployment, prefill, strangers
    finally:
        for stranger in strangers:
            stranger.close()
        for agent in prefill:
            agent.close()
        deployment.close()


def test_a_strangers_metadata_and_abort_never_fail_a_later_room_on_a_prefill_rank() -> None:
    """Found in review: one Metadata for a made-up room made a stranger count as a decode rank on prefill, and its
    Abort of a room not attached yet closed that room id there, so the real room failed when it came."""
    with _strangers_at_prefill(Caps(timing=PATIENT)) as (deployment, prefill, strangers):
        metadata = Metadata(room=999, decode_rank=0, decode_tp=1, prefill_tp=2, num_tokens=24, prefix_tokens=0,
                            chunk_tokens=8, page_size=4, path="staged", epoch=1, ttl_s=10.0)  # fmt: skip
        for stranger in strangers:
            stranger.send("evil/0", metadata)
            stranger.send("evil/0", Abort(room=42, reason="aborted by decode"))
        _wait(lambda: all(a.channel.received >= 2 for a in prefill), "both ranks handled them")
        assert all(not a.endpoint.peers() for a in prefill), "a stranger reached a prefill endpoint"
        for room in (42, 43):
            assert all(o.ok for o in deployment.run_room(room, "P", prefill)), room


def test_strangers_that_keep_talking_never_lock_a_decode_rank_out_of_a_prefill_rank() -> None:
    """Found in review: a prefill rank learns its decode ranks only from their frames, and strangers that kept
    sending heartbeats held every one of its `max_peers` peer entries, so a real decode rank's Metadata was refused
    ("too many peers") and its rooms timed out."""
    with _strangers_at_prefill(Caps(timing=PATIENT, limits=Limits(max_peers=4))) as (deployment, prefill, strangers):
        for room in range(1, 4):
            for stranger in strangers:  # more chatty strangers than the prefill ranks track peers, between rooms
                for i in range(8):
                    stranger.send(f"ghost-{i}/0", Heartbeat())
            assert all(o.ok for o in deployment.run_room(room, "P", prefill)), room
        assert all(set(a.endpoint.peers()) == {"D/0"} for a in prefill), "only the decode rank reached the endpoints"


def test_frames_under_a_writers_id_but_not_its_registered_session_never_change_its_room() -> None:
    """Found in review: decode took a frame's (session, epoch) at its word. An Abort under the writer's id before the
    writer registered failed the room, and one heartbeat with a larger session made decode declare the writer
    restarted (failing its room) and then drop every frame of the real one as stale."""
    deployment = Deployment(Caps(timing=PATIENT))
    impostor = Stranger(deployment.decode.channel.address)
    prefill: list[PrefillAgent] = []
    try:
        deployment.expect(1, "P")
        impostor.send("P/0", Abort(room=1, reason="aborted by prefill"), session=1)  # before P/0 registered
        prefill = prefill_instance("P", deployment.bootstrap.address, deployment.caps)
        impostor.send("P/0", Heartbeat(), session=2**63 - 1)  # after: a "restart" the bootstrap never saw
        dropped = lambda: (_rejected(deployment.decode, STALE_SESSION), _rejected(deployment.decode, UNREGISTERED))  # noqa: E731
        _wait(lambda: dropped() == (1, 1), "both frames dropped once P/0 resolved", dropped)
        _serve(deployment, 1, prefill)
        deployment.expect(2, "P")
        _serve(deployment, 2, prefill)
    finally:
        for agent in prefill:
            agent.close()
        impostor.close()
        deployment.close()


def test_a_decode_rank_whose_first_frame_came_amid_strangers_frames_is_asked_about_again_not_locked_out() -> None:
    """Found in a fresh-clone run: a busy prefill reactor read a decode rank's first Metadata between strangers'
    frames (ZeroMQ reads its connections in turn), the strangers' peers evicted the decode rank from the resolver's
    wanted set before it was resolved, and its retries, held behind its first frame, never asked again: its room
    failed as "peer dead" on decode. Each prefill reactor is held here while the frames queue up in that order."""
    caps = Caps(timing=PATIENT, limits=Limits(max_peers=4))
    with _strangers_at_prefill(caps) as (deployment, prefill, strangers):
        go = threading.Event()
        for agent in prefill:  # the reactors are busy: what comes waits in ZeroMQ's queues
            agent._mailbox.put(AgentTask(lambda: go.wait(10)))
        for stranger in strangers:
            stranger.send("ghost-0/0", Heartbeat())
        outcomes: list[RoomOutcome] = []
        room = threading.Thread(target=lambda: outcomes.extend(deployment.run_room(1, "P", prefill)))
        room.start()
        time.sleep(0.5)  # decode's Metadata waits at each prefill rank, after the strangers' first frame
        for stranger in strangers:
            for i in range(1, 8):
                stranger.send(f"ghost-{i}/0", Heartbeat())
        time.sleep(0.2)
        go.set()
        room.join(60)
        assert outcomes and all(o.ok for o in outcomes), outcomes
