"""The simulated world's event loop: real protocol endpoints driven by seeded engines, a faulty network and
checked memory.

Owns `World`, which plays one seeded run. It is made of parts: `WorldCore` (core.py, the shared state),
`Engines` (engines.py, the decode and prefill engine models) and `DataPlane` (dataplane.py, writes and
scatters). This module builds them, schedules the scenario, runs the event loop in virtual time (`step`, one
`EventKind` at a time), feeds the endpoints (the real ones from kvstage.protocol) and carries out every action
they return:

- `Send`: encoded with the real codec and handed to the `Network` (loss, duplication, delay, partitions);
- `WriteRegion` / `WriteDirect` / `Scatter` / `FenceScatter`: the data plane;
- `FreePages`, `RoomSucceeded`, `RoomFailed`: the engines; `FencePeer`: the data plane's fence table.

Every random choice comes from the world's one `random.Random(seed)`, drawn in event order, so a seed replays
exactly. The `Checker` (sim/invariants.py) is called at every data operation and after every step.
Called by sim/runner.py.
"""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter
from collections.abc import Callable
from time import perf_counter
from typing import Any, assert_never

from kvstage.protocol import (
    Codec,
    Event,
    FencePeer,
    FenceScatter,
    FreePages,
    ReceivedFrame,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    SendFailed,
    Tick,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.actions import Action
from kvstage.sim.clock import EventKind, EventQueue
from kvstage.sim.dataplane import DataPlane
from kvstage.sim.engines import Engines
from kvstage.sim.hostile import hostile_frame
from kvstage.sim.invariants import Checker
from kvstage.sim.network import Delivery, Network
from kvstage.sim.records import DRAIN_S, MAX_STEPS, DecodeInstance, Node, PrefillInstance, RoomState, RunResult
from kvstage.sim.scenario import SimConfig, make_scenario
from kvstage.sim.trace import ACTION, EVENT, Trace

__all__ = ["RunResult", "World"]

#: Event kinds that mean something is still in flight (the run is not quiescent while one is pending).
_IN_FLIGHT = frozenset({EventKind.DELIVER, EventKind.COMPLETE, EventKind.SCATTER, EventKind.LAND})


class World(DataPlane, Engines):
    """One seeded run; `run()` plays it to quiescence (or the first violation) and returns the result."""

    def __init__(self, seed: int, config: SimConfig, *, keep_trace: bool = False) -> None:
        self.seed = seed
        self.config = config
        self.profile = config.profile
        self.rng = random.Random(seed)
        self.queue = EventQueue()
        self.scenario = make_scenario(self.rng, config)
        self.network = Network(self.rng, self.profile, self.queue)
        self.trace = Trace(50, keep_all=keep_trace)
        self.codec = Codec()
        self.layout = self.scenario.layout
        self.payloads = config.payloads
        self.events = 0
        self.core_s = 0.0
        """Wall seconds spent inside endpoint calls (the protocol core alone)."""
        self.steps = 0
        self._sessions = 0
        self._tokens = 0
        self.nodes = {}
        self.writes = {}
        self.scatters = {}
        self.fences = {}
        self.rooms = {}
        topology = self.scenario.topology
        self.prefill = [
            PrefillInstance(i, tp, config.chunk_tokens * self.rng.choice((1, 2)) // self.rng.choice((1, 2)))
            for i, tp in enumerate(topology.prefill_tp)
        ]
        self.decode = [DecodeInstance(i, tp) for i, tp in enumerate(topology.decode_tp)]
        for decode in self.decode:
            self._build_decode(decode)
        for prefill in self.prefill:
            self._start_prefill(prefill)
        self._schedule_scenario()
        self.checker = Checker(self)
        self._handlers: dict[EventKind, Callable[[Any], None]] = {
            EventKind.ARRIVE: self._on_arrive,
            EventKind.DELIVER: self._on_deliver,
            EventKind.TICK: self._on_tick,
            EventKind.LAND: self._on_land,
            EventKind.COMPLETE: self._on_complete,
            EventKind.SCATTER: self._on_scatter_done,
            EventKind.FORWARD: self._on_forward_done,
            EventKind.ABORT: self._on_abort,
            EventKind.EXPIRE: self._on_expire,
            EventKind.GENERATED: self._on_generated,
            EventKind.CRASH: self._on_crash,
            EventKind.RESTART: self._on_restart,
            EventKind.PARTITION: self._on_partition,
            EventKind.HOSTILE: self._on_hostile,
        }

    def _schedule_scenario(self) -> None:
        profile = self.profile
        last_arrival = 0.0
        for plan in self.scenario.rooms:
            self.rooms[self._room_id(plan)] = RoomState(plan)
            self.queue.push(plan.arrival, EventKind.ARRIVE, self._room_id(plan))
            if plan.abort_at is not None:
                self.queue.push(plan.abort_at, EventKind.ABORT, self._room_id(plan))
            last_arrival = plan.arrival
        self.last_deadline = max(plan.deadline for plan in self.scenario.rooms)
        span = last_arrival + 0.2
        for _ in range(profile.prefill_crashes):
            self.queue.push(self.rng.uniform(0.0, span), EventKind.CRASH, self.rng.randrange(len(self.prefill)))
        for _ in range(profile.partitions):
            self.queue.push(self.rng.uniform(0.0, span), EventKind.PARTITION, None)
        if profile.hostile_frames:
            count = max(1, round(profile.hostile_frames * 100))
            for _ in range(count):
                self.queue.push(self.rng.uniform(0.0, span), EventKind.HOSTILE, None)

    # ---- the main loop -----------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Play the world to its end, or its first violation."""
        start, start_cpu = time.perf_counter(), time.process_time()
        while self.step():
            pass
        return self._result(time.perf_counter() - start, time.process_time() - start_cpu)

    def step(self) -> bool:
        """Play the next world event and check the invariants; False once the run is over."""
        checker = self.checker
        entry = self.queue.pop() if not checker.violations else None
        if entry is None or entry.time > self.last_deadline + DRAIN_S:
            if not checker.violations:
                checker.at_end()
            return False
        self.steps += 1
        if self.steps > MAX_STEPS:
            checker.fail("L1", f"more than {MAX_STEPS} world steps: the protocol keeps itself busy")
            return False
        self._handlers[entry.kind](entry.payload)
        checker.after_step()
        if checker.violations:
            return False
        if self.steps % 64 == 0 and checker.all_rooms_done() and self._quiescent():
            checker.at_end()
            return False
        return True

    def _result(self, wall: float, cpu: float) -> RunResult:
        failed: Counter[str] = Counter()
        succeeded = 0
        for state in self.rooms.values():
            if state.succeeded:
                succeeded += 1
            elif state.decode_done:
                failed[state.failure_reason()] += 1
            else:
                failed["unfinished"] += 1
        digest = self.trace.digest() if self.trace.keep_all else None
        tail = self.trace.lines() if self.trace.keep_all else self.trace.tail() if self.checker.violations else []
        return RunResult(
            seed=self.seed,
            rooms=len(self.rooms),
            succeeded=succeeded,
            failed_by_reason=failed,
            violations=list(self.checker.violations),
            events=self.events,
            steps=self.steps,
            wall_s=wall,
            cpu_s=cpu,
            core_s=self.core_s * min(1.0, cpu / wall) if wall > 0 else 0.0,
            trace=tail,
            digest=digest,
        )

    def _quiescent(self) -> bool:
        """Nothing in flight and every endpoint idle: the run is over (Q1 is then checked)."""
        if self.writes or any(self.scatters.values()) or self.fences:
            return False
        if any(p.busy or p.waiting or p.active or p.holding for p in self.prefill):
            return False
        if any(not s.pages_freed and s.decode_admitted for s in self.rooms.values()):
            return False
        for node in self.nodes.values():
            if node.endpoint is not None and not node.endpoint.is_quiescent():
                return False
        return not any(entry.kind in _IN_FLIGHT for entry in self.queue.pending())

    # ---- feeding endpoints -------------------------------------------------------------------------------------------

    def feed(self, node: Node, event: Event) -> None:
        """Hand `event` to `node`'s endpoint at the current time and carry out the actions it returns."""
        endpoint = node.endpoint
        if endpoint is None:
            return
        now = self.queue.now
        self.events += 1
        self.trace.record(now, node.peer_id, EVENT, event)
        began = perf_counter()
        try:
            actions = endpoint.handle(event, now)
        except Exception as exc:  # noqa: BLE001 - an endpoint that raises is a finding: report seed and trace
            self.core_s += perf_counter() - began
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.checker.fail(
                "crash",
                f"{node.peer_id} raised {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})",
            )
            node.endpoint = None  # a crashed endpoint handles nothing more; the run stops after this step
            return
        self.core_s += perf_counter() - began
        for action in actions:
            self._execute(node, action)
        self._reschedule_timer(node)
        self.checker.after_feed(node)

    def _reschedule_timer(self, node: Node) -> None:
        endpoint = node.endpoint
        due = endpoint.next_timer() if endpoint is not None else None
        if node.timer is not None:
            if due is not None and node.timer.time == max(due, self.queue.now) and not node.timer.cancelled:
                return
            self.queue.cancel(node.timer)
            node.timer = None
        if due is not None:
            node.timer = self.queue.push(due, EventKind.TICK, (node, node.session))

    def _on_tick(self, payload: tuple[Node, int]) -> None:
        node, session = payload
        if node.session == session and node.endpoint is not None:
            node.timer = None
            self.feed(node, Tick())

    def _execute(self, node: Node, action: Action) -> None:
        self.trace.record(self.queue.now, node.peer_id, ACTION, action)
        match action:
            case Send():
                self._send(node, action)
            case WriteRegion() | WriteDirect():
                self._issue_write(node, action)
            case Scatter():
                self._issue_scatter(node, action)
            case FenceScatter():
                self._issue_fence(node, action)
            case FreePages():
                self._free_decode_pages(node, action)
            case FencePeer():
                self._fence_peer(node, action)
            case RoomSucceeded():
                self._room_succeeded(node, action.room)
            case RoomFailed():
                self._room_failed(node, action.room, action.reason)
            case _:
                assert_never(action)  # mypy names this line when an Action is added and not handled here

    # ---- control plane -----------------------------------------------------------------------------------------------

    def _send(self, node: Node, action: Send) -> None:
        envelope = action.envelope
        if node.side == "decode":
            self.checker.observe_decode_send(node, envelope)
        if self.profile.send_failure and self.rng.random() < self.profile.send_failure:
            self._complete(node, node.session, SendFailed(action.peer, envelope, "sim"), self.queue.now)
            return
        self.network.send(node.peer_id, action.peer, self.codec.encode(envelope))

    def _on_deliver(self, payload: Delivery) -> None:
        node = self.nodes.get(payload.dst)
        if node is not None and node.endpoint is not None:
            self.feed(node, ReceivedFrame(payload.frame))

    def _on_hostile(self, _payload: None) -> None:
        names = sorted(self.nodes)
        node = self.nodes[self.rng.choice(names)]
        frame = hostile_frame(self.rng, self.codec, names, sorted(self.rooms))
        self.checker.hostile_sent += 1
        if node.endpoint is not None:
            self.feed(node, ReceivedFrame(frame))

    def _on_partition(self, _payload: None) -> None:
        names = sorted(self.nodes)
        side = frozenset(self.rng.sample(names, self.rng.randint(1, max(1, len(names) // 3))))
        length = self.rng.uniform(0.1, self.profile.partition_length)
        self.trace.record(self.queue.now, "world", "partition", f"{sorted(side)} for {length * 1000:.0f}ms")
        self.network.partition(side, self.queue.now + length)

    def _on_complete(self, payload: tuple[Node, int, Event]) -> None:
        node, session, event = payload
        if node.session == session and node.endpoint is not None:
            self.feed(node, event)
