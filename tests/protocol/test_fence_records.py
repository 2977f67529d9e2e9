"""Fence records are released by rule, not by count (docs/protocol.md, "Fence records").

A fence stays until no room of the fenced incarnation can still be written: the latest deadline of the rooms it
held, stretched by clock drift, plus `quarantine_s`. These tests drive real endpoints through the FIFO pump of
protocol_harness: a writer paused (SIGSTOP, swap) while more than `Limits.max_peers` other incarnations are fenced
comes back still fenced, and its parked write is never posted into ring space decode released meanwhile.
"""

from __future__ import annotations

from protocol_harness import (
    TIMING,
    Pump,
    attach,
    decode,
    expect,
    inject,
    make_pump,
    prefill,
)

from kvstage.protocol import ComputeScheduled, KVReady, Limits, ReceivedFrame
from kvstage.protocol.messages import Envelope, Heartbeat


def _fence_strangers(pump: Pump, first: int, count: int) -> None:
    """`count` peers each appear and restart once: decode fences the first incarnation of every one of them."""
    for i in range(first, first + count):
        inject(pump, "d0", f"w{i}", Heartbeat(), session=1)
        inject(pump, "d0", f"w{i}", Heartbeat(), session=2)


def _pause(pump: Pump, name: str) -> list[Envelope]:
    """Stop `name` like SIGSTOP: it runs no timer and handles nothing; what is sent to it is kept for later."""
    held: list[Envelope] = []
    pump.endpoints.pop(name)
    pump.drop = lambda src, dst, env: dst == name and held.append(env) is None
    return held


def _resume(pump: Pump, name: str, endpoint: object, held: list[Envelope]) -> None:
    pump.endpoints[name] = endpoint  # type: ignore[assignment]
    pump.drop = None
    for envelope in held:
        pump.queue.append((name, ReceivedFrame(pump.codec.encode(envelope))))
    pump.run()


def test_a_writer_paused_while_1100_other_incarnations_are_fenced_comes_back_fenced() -> None:
    pump = make_pump(limits=Limits(max_peers=1024))
    expect(pump, 1, 16, deadline=100.0)
    attach(pump, 1, 16, deadline=100.0)
    pump.run()
    pump.call("p0", ComputeScheduled(1, 16))  # p0 is granted its chunks, then stalls before its KV is ready
    pump.run()
    writer = prefill(pump)
    held = _pause(pump, "p0")
    pump.advance(4.0)  # d0 declares p0 dead and releases the room's ring space at once
    assert ("d0", "p0") in pump.fenced
    assert decode(pump).ring.num_live == 0
    for batch in range(3):  # 1,100 newer fences, in batches the peer table can hold (silent peers are pruned)
        _fence_strangers(pump, batch * 400, 400 if batch < 2 else 300)
        pump.advance(pump.now + TIMING.dead_after_s + 0.5)
    assert decode(pump).stats.peers_restarted == 1100
    _resume(pump, "p0", writer, held)
    pump.call("p0", KVReady(1, 16, tuple(51_000 + i for i in range(4))))
    pump.advance(pump.now + 3 * TIMING.heartbeat_s)  # p0's heartbeat would renew its lease if d0 forgot the fence
    assert pump.writes_landed == 0, "the paused writer's old grants must never be written"
    assert pump.outcome("p0", 1) is not None
    assert prefill(pump).epoch_towards("d0") == 1, "d0 answered the old incarnation with Fenced"


def test_fence_records_go_once_no_room_of_the_incarnation_can_still_be_written() -> None:
    pump = make_pump()
    _fence_strangers(pump, 0, 50)  # incarnations that held no room: kept for quarantine_s only
    assert len(decode(pump)._fenced) == 50
    pump.advance(TIMING.quarantine_s + TIMING.heartbeat_s + 0.01)
    assert len(decode(pump)._fenced) == 0
    expect(pump, 1, 16, deadline=40.0)
    attach(pump, 1, 16, deadline=40.0)
    pump.run()
    writer = prefill(pump)
    held = _pause(pump, "p0")
    pump.advance(pump.now + TIMING.dead_after_s + 1.0)
    assert "p0" in decode(pump)._fenced
    stretch = (1 + TIMING.clock_drift) / (1 - TIMING.clock_drift)
    release_at = decode(pump)._fenced["p0"].release_at  # the room's deadline (40), stretched, plus quarantine_s
    assert 40.0 + TIMING.quarantine_s < release_at <= 40.0 * stretch + TIMING.quarantine_s
    _resume(pump, "p0", writer, held)
    pump.advance(39.0)
    assert "p0" in decode(pump)._fenced
    pump.advance(release_at + TIMING.heartbeat_s + 0.01)
    assert "p0" not in decode(pump)._fenced


def test_at_the_fence_cap_a_new_peer_waits_instead_of_a_needed_fence_being_forgotten() -> None:
    pump = make_pump(limits=Limits(max_fences=4))
    _fence_strangers(pump, 0, 4)
    inject(pump, "d0", "newcomer", Heartbeat())
    assert "newcomer" not in decode(pump).peers()
    assert decode(pump).stats.messages_rejected["fence records full"] == 1
    assert len(decode(pump)._fenced) == 4
    pump.now = TIMING.quarantine_s + 0.01  # none of the four held a room: their fences are released by now
    inject(pump, "d0", "newcomer", Heartbeat())
    assert "newcomer" in decode(pump).peers()
    assert len(decode(pump)._fenced) == 0
