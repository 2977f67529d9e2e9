"""R8 counts a peer's silence only while the endpoint that judges it ran: an endpoint that was itself stalled (its
thread starved, its process or machine paused) past `dead_after_s` does not declare a live peer dead when it runs
again, and a peer that stays silent is still declared dead once the judge has run `dead_after_s` without hearing it."""

from __future__ import annotations

from protocol_harness import TIMING, Pump, attach, compute, decode, expect, make_pump

from kvstage.protocol import Tick, reasons

STALL_S = 3 * TIMING.dead_after_s


def _stall_decode(pump: Pump, until: float) -> list[tuple[str, object]]:
    """Run every endpoint but d0 up to `until`; what they send d0 waits for it (its process did not run)."""
    waiting: list[tuple[str, object]] = []
    others = {name: ep for name, ep in pump.endpoints.items() if name != "d0"}
    waiting.extend(item for item in pump.queue if item[0] == "d0")
    pump.queue = type(pump.queue)(item for item in pump.queue if item[0] != "d0")
    while True:
        timers = [t for ep in others.values() if (t := ep.next_timer()) is not None and t <= until]
        if not timers:
            break
        pump.now = max(pump.now, min(timers))
        for name, ep in others.items():
            timer = ep.next_timer()
            if timer is not None and timer <= pump.now:
                for action in ep.tick(pump.now):
                    pump._execute(name, action)
        while pump.queue:
            name, event = pump.queue.popleft()
            if name == "d0":
                waiting.append((name, event))
            else:
                pump.call(name, event)
    pump.now = until
    return waiting


def test_a_machine_paused_past_dead_after_leaves_every_peer_alive_and_the_room_succeeds() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    pump.now += STALL_S  # nobody ran: a paused VM, a swap storm
    for name, endpoint in pump.endpoints.items():  # each one's timers run before anything reaches its inbox
        for action in endpoint.tick(pump.now):
            pump._execute(name, action)
    compute(pump, 1, 16)
    pump.advance(pump.now + 2.0)
    assert pump.outcome("d0", 1) == "ok" and pump.outcome("p0", 1) == "ok" and pump.outcome("p1", 1) == "ok"
    assert all(ep.stats.peers_dead == 0 and ep.stats.own_stalls == 1 for ep in pump.endpoints.values())


def test_an_endpoint_stalled_alone_past_dead_after_does_not_declare_the_peers_that_kept_running_dead() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    waiting = _stall_decode(pump, pump.now + STALL_S)
    assert waiting, "the prefill ranks kept sending while decode was stalled"
    pump.call("d0", Tick())  # its timer runs before its inbox
    assert pump.outcome("d0", 1) is None, "decode declared a prefill rank dead for its own stall"
    assert decode(pump).stats.own_stalls == 1
    pump.queue.extend(waiting)
    pump.advance(pump.now + 2.0)
    # the prefill ranks did hear nothing from decode for longer than dead_after_s while they ran: theirs is the
    # judgement, and decode learns it from their Fenced
    assert pump.outcome("d0", 1) == reasons.FENCED_BY_PEER
    assert decode(pump).stats.peers_dead == 0


def test_a_peer_silent_after_the_judges_stall_is_still_declared_dead_after_dead_after_of_running_time() -> None:
    pump = make_pump()
    expect(pump, 1, 16)
    attach(pump, 1, 16)
    pump.run()
    _stall_decode(pump, pump.now + STALL_S)  # and what the prefill ranks sent meanwhile is lost
    resumed = pump.now
    pump.drop = lambda src, dst, env: src.startswith("p")  # the prefill ranks are gone from here on
    pump.advance(resumed + TIMING.dead_after_s - 2 * TIMING.heartbeat_s)
    assert pump.outcome("d0", 1) is None
    pump.advance(resumed + TIMING.dead_after_s + 2 * TIMING.heartbeat_s)
    assert pump.outcome("d0", 1) == reasons.PEER_DEAD
