"""R13, writer leases: no write lands in ring space that decode has released, whatever the writer's fate.

A writer posts a write to a decode rank only while `now < lease_until(decode)`: `lease_s` after the latest of its
own frames that decode has echoed. Decode therefore knows that a fenced writer's writes land by
`last_heard + quarantine_s` at the latest: a dead writer (silent for `dead_after_s >= quarantine_s`) is safe at
once, a restarted one only once that time has passed. The pump lands a held write whenever the test releases it
(a one-sided write cannot be recalled) and checks that its region is still allocated to it.
"""

from __future__ import annotations

import msgspec
import pytest
from protocol_harness import (
    TIMING,
    Pump,
    all_quiescent,
    attach,
    compute,
    decode,
    expect,
    full_room,
    layout,
    make_pump,
    prefill,
    writes_of,
)

from kvstage.errors import ConfigError, ProtocolError
from kvstage.protocol import (
    AbortRoom,
    Codec,
    ComputeScheduled,
    KVReady,
    PrefillConfig,
    PrefillEndpoint,
    ReceivedFrame,
    Timing,
    WriteRegion,
    reasons,
)
from kvstage.protocol.messages import PROTOCOL_VERSION, Envelope, Heartbeat


def restart(pump: Pump, name: str, session: int) -> None:
    old = prefill(pump, name).config
    pump.endpoints[name] = PrefillEndpoint(PrefillConfig(name, old.layout, old.tp_size, old.rank, TIMING), session)


# ---- the configuration check ------------------------------------------------------------------------------------
def test_dead_after_below_lease_plus_max_write_is_refused_naming_the_bound() -> None:
    with pytest.raises(ConfigError, match=r"dead_after_s=4.0 must be at least .* = 4.008"):
        Timing(heartbeat_s=0.5, dead_after_s=4.0, lease_s=2.0, max_write_s=2.0)


def test_lease_shorter_than_a_heartbeat_round_trip_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lease_s=0.5 must be at least 2 \* heartbeat_s"):
        Timing(heartbeat_s=0.5, dead_after_s=5.0, lease_s=0.5)


def test_lease_and_write_bound_default_to_a_share_of_dead_after_that_passes_the_check() -> None:
    timing = Timing(heartbeat_s=0.1, dead_after_s=2.0)
    assert timing.lease_s == timing.max_write_s == pytest.approx(0.9)
    assert timing.quarantine_s <= timing.dead_after_s


def test_a_planted_unsafe_timing_can_be_built_only_unchecked_and_reports_its_problem() -> None:
    timing = Timing.unchecked(heartbeat_s=0.1, dead_after_s=1.0, lease_s=0.8, max_write_s=0.8)
    assert any("dead_after_s=1.0 must be at least" in problem for problem in timing.problems())


# ---- the wire -----------------------------------------------------------------------------------------------------
def test_a_frame_of_protocol_version_1_without_lease_clocks_is_refused_by_its_version() -> None:
    old_frame = msgspec.msgpack.encode([1, "p0", 1, 0, 1, None, ["hb"]])
    with pytest.raises(ProtocolError, match=f"protocol version 1, this endpoint speaks {PROTOCOL_VERSION}"):
        Codec().decode(old_frame)


def test_every_envelope_carries_the_senders_clock_and_echoes_the_addressees() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    pump.now = 0.25
    attach(pump, 1, 16)
    pump.run()
    sent = [(src, a.peer, a.envelope) for src, a in pump.log if hasattr(a, "envelope")]
    acks = [env for src, dst, env in sent if src == "p0" and dst == "d0"]
    assert acks and all(env.stamp == 0.25 and env.echo == 0.0 for env in acks)  # d0's metadata was stamped at 0.0
    assert prefill(pump).lease_until("d0") == pytest.approx(0.25 + TIMING.lease_s)  # d0 answered p0's frame of 0.25


def test_an_echo_from_the_future_or_from_before_the_writer_started_grants_no_lease() -> None:
    codec = Codec()
    writer = PrefillEndpoint(PrefillConfig("p0", layout(), 2, 0, TIMING), session=1)
    writer.tick(10.0)  # born at 10.0
    for echo in (9.0, 11.0):
        frame = Envelope(PROTOCOL_VERSION, "d0", 1, 0, 1, None, Heartbeat(), stamp=3.0, echo=echo)
        writer.handle(ReceivedFrame(codec.encode(frame)), 10.5)
        assert writer.lease_until("d0") == 0.0


# ---- posting only under a lease -----------------------------------------------------------------------------------
def granted_but_not_computed(pump: Pump) -> None:
    """Room 1 (16 tokens): every chunk granted to p0 and p1, whose KV is not ready yet."""
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    for name in ("p0", "p1"):
        pump.call(name, ComputeScheduled(1, 16))
    pump.run()


def kv_ready(pump: Pump, name: str) -> None:
    pump.call(name, KVReady(1, 16, (51_000, 51_001, 51_002, 51_003)))
    pump.run()


def writes_from(pump: Pump, name: str) -> list[WriteRegion]:
    return [a for src, a in pump.log if src == name and isinstance(a, WriteRegion)]


def test_a_writer_cut_off_from_decode_posts_no_write_until_a_frame_renews_its_lease() -> None:
    pump = make_pump()
    granted_but_not_computed(pump)
    pump.drop = lambda src, dst, env: src == "d0" and dst == "p0"  # p0 hears nothing from d0 from now on
    pump.advance(TIMING.lease_s + 0.1)
    assert pump.now >= prefill(pump).lease_until("d0")
    kv_ready(pump, "p0")
    assert not writes_from(pump, "p0")
    assert prefill(pump).stats.lease_waits == 2  # both chunks parked for the lease
    pump.drop = None  # d0's next heartbeat renews the lease and re-checks the parked chunks
    kv_ready(pump, "p1")
    pump.advance(pump.now + 1.0)
    assert len(writes_from(pump, "p0")) == 2
    assert pump.outcome("d0", 1) == "ok" and pump.outcome("p0", 1) == "ok"
    assert all_quiescent(pump)


def test_a_writer_declared_dead_has_no_lease_left_when_decode_reuses_its_space() -> None:
    pump = make_pump()
    granted_but_not_computed(pump)
    assert decode(pump).ring.num_live == 2
    pump.drop = lambda src, dst, env: "p0" in (src, dst)  # p0 partitioned; it stays alive and keeps computing
    pump.advance(TIMING.dead_after_s + TIMING.heartbeat_s + 0.1)
    assert pump.outcome("d0", 1) == reasons.PEER_DEAD
    assert decode(pump).ring.num_live == 0, "a dead writer's space is reused at once"
    assert pump.now >= prefill(pump).lease_until("d0"), "the writer's lease ran out before decode declared it dead"
    kv_ready(pump, "p0")
    assert not writes_from(pump, "p0")


def test_a_write_held_across_a_fence_of_its_writer_is_never_posted_under_the_renewed_lease() -> None:
    """Found in review: a runtime holds emitted writes until the lease allows them (window full, gather running).
    With p0 -> d0 cut, d0 declares p0 dead and reuses the ring while p0 still hears d0; when the cut heals p0 is
    fenced, starts epoch 1, and d0's echoes of that epoch renew the lease. The held writes belong to epoch 0: a
    poster that checked only the lease posted them into reused space; `may_post` refuses them for good."""
    pump = make_pump()
    granted_but_not_computed(pump)
    pump.hold = writes_of("p0")  # what p0's runtime queues instead of posting
    pump.drop = lambda src, dst, env: src == "p0" and dst == "d0"
    kv_ready(pump, "p0")
    held = [action for _, action in pump.held]
    assert held and all(isinstance(a, WriteRegion) and a.writer_epoch == 0 for a in held)
    pump.advance(pump.now + TIMING.dead_after_s + TIMING.heartbeat_s + 0.2)
    assert pump.outcome("d0", 1) == reasons.PEER_DEAD and decode(pump).ring.num_live == 0
    expect(pump, 2, 16)  # d0 keeps talking to p0 (room 2 names it), so p0 never declares d0 dead
    pump.drop = None
    pump.advance(pump.now + 1.0)
    p0 = prefill(pump)
    assert p0.epoch_towards("d0") == 1 and pump.now < p0.lease_until("d0"), "fenced, and the lease renewed"
    assert not any(p0.may_post(a, pump.now) for a in held), "a write of epoch 0 posted under epoch 1's lease"


# ---- decode's quarantine of a restarted writer ------------------------------------------------------------------
def test_a_restarted_writers_ring_space_stays_quarantined_until_its_old_writes_cannot_land() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    full_room(pump, 1, 8)
    restart(pump, "p0", session=2)
    pump.hold = None
    full_room(pump, 2, 8)
    assert pump.outcome("d0", 1) == reasons.PEER_RESTARTED
    assert decode(pump).stats.quarantine_timers == 1
    assert len(decode(pump).ring.live()) == 1, "room 1's region is held for the old process's write"
    pump.advance(TIMING.quarantine_s - 0.1)
    pump.release_held()  # the dead process's write lands late, into its own still-allocated region
    pump.run()
    assert len(decode(pump).ring.live()) == 1
    pump.advance(TIMING.quarantine_s + 0.1)
    assert decode(pump).ring.num_live == 0
    assert all_quiescent(pump)


def test_an_abort_ack_from_a_restarted_writer_does_not_vouch_for_its_old_writes() -> None:
    pump = make_pump()
    pump.hold = writes_of("p0")
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    compute(pump, 1, 16)
    pump.run()
    restart(pump, "p0", session=2)
    pump.hold = None
    pump.call("d0", AbortRoom(1))  # the new p0 answers d0's Abort at once: it knows no room 1
    full_room(pump, 2, 16)
    assert pump.outcome("d0", 2) == "ok"
    assert decode(pump).room_state(1) is not None, "room 1 is still quarantined for the old p0's writes"
    pump.advance(TIMING.quarantine_s + 0.1)
    assert decode(pump).room_state(1) is None and decode(pump).ring.num_live == 0
    assert all_quiescent(pump)
