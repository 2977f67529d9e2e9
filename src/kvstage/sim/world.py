"""The simulated world's event loop: real protocol endpoints driven by seeded engines, a faulty network and
checked memory.

Owns `World`, which plays one seeded run. It is made of parts: `WorldCore` (core.py, the shared state),
`Engines` (engines.py, the decode and prefill engine models) and `DataPlane` (dataplane.py, writes and
scatters). This module builds them, schedules the scenario, runs the event loop in virtual time (`step`, one
`EventKind` at a time), feeds the endpoints (the real ones from kvstage.protocol) and carries out every action
they return:

- `Send`: encoded with the real codec and handed to the `Network` (loss, duplication, delay, partitions);
- `WriteRegion` / `WriteDirect` / `Scatter` / `FenceScatter`: the data plane;
- `FreePages`, `RoomSucceeded`, `RoomFailed`: the engines;
- `FencePeer`: nothing the world can do: the endpoint drops the fenced incarnation's frames itself, and
  one-sided transports cannot refuse its writes (the writer's lease bounds them).

Each node reads its own clock (`Node.clock`): every `handle` gets that node's `now`, and its timers are scheduled
at the true time its clock reaches them. A paused node (a stalled writer) holds everything that reaches it until
it resumes. The world also plays the process faults (writer partitions, pauses, decode crashes, restarts in
quarantine) and the hostile peer, which forges, replays and alters real frames it saw on the wire.

Every random choice comes from the world's one `random.Random(seed)`, drawn in event order, so a seed replays
exactly. The `Checker` (sim/invariants.py) is called at every data operation and after every step.
Called by sim/runner.py.
"""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from time import perf_counter
from typing import Any, assert_never

from kvstage.protocol import (
    Codec,
    Event,
    FencePeer,
    FenceScatter,
    FreePages,
    PrefillEndpoint,
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
from kvstage.protocol.messages import Envelope, Grant
from kvstage.sim.clock import EventKind, EventQueue
from kvstage.sim.dataplane import DataPlane
from kvstage.sim.engines import Engines
from kvstage.sim.hostile import RECENT_FRAMES, forged_from, hostile_frame, stale_chunk_ready
from kvstage.sim.invariants import Checker
from kvstage.sim.network import Delivery, Network, Partition
from kvstage.sim.records import (
    DRAIN_S,
    MAX_STEPS,
    DecodeInstance,
    Node,
    PendingPost,
    PrefillInstance,
    RoomState,
    RunResult,
)
from kvstage.sim.scenario import SimConfig, make_scenario
from kvstage.sim.trace import ACTION, EVENT, Trace

__all__ = ["RunResult", "World"]

#: Event kinds that mean something is still in flight (the run is not quiescent while one is pending).
_IN_FLIGHT = frozenset(
    {EventKind.DELIVER, EventKind.COMPLETE, EventKind.SCATTER, EventKind.LAND, EventKind.POST, EventKind.RESUME}
)


class World(DataPlane, Engines):
    """One seeded run; `run()` plays it to quiescence (or the first violation) and returns the result."""

    def __init__(self, seed: int, config: SimConfig, *, keep_trace: bool = False) -> None:
        self.seed = seed
        self.config = config
        self.profile = config.profile
        self.rng = random.Random(seed)
        self.edge_rng = random.Random(f"edges/{seed}")
        edge_rate = self.profile.edge_restarts
        self.edges = int(edge_rate) + (self.edge_rng.random() < edge_rate % 1)
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
        self._forgeries_armed = 0
        self._recent: deque[tuple[str, str, Envelope]] = deque(maxlen=RECENT_FRAMES)
        self.nodes = {}
        self.clocks = {}
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
            EventKind.POST: self._on_post,
            EventKind.CRASH: self._on_crash,
            EventKind.RESTART: self._on_restart,
            EventKind.DECODE_CRASH: self._on_decode_crash,
            EventKind.DECODE_RESTART: self._on_decode_restart,
            EventKind.QUARANTINE_RESTART: self._on_quarantine_restart,
            EventKind.PARTITION: self._on_partition,
            EventKind.WRITER_PARTITION: self._on_writer_partition,
            EventKind.PAUSE: self._on_pause_armed,
            EventKind.EDGE_RESTART: self._on_edge_armed,
            EventKind.RESUME: self._on_resume,
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
            crash = (self.rng.randrange(len(self.prefill)), self.rng.uniform(0.05, 2 * self.config.timing.dead_after_s))
            self.queue.push(self.rng.uniform(0.0, span), EventKind.CRASH, crash)
        for _ in range(profile.partitions):
            self.queue.push(self.rng.uniform(0.0, span), EventKind.PARTITION, None)
        for _ in range(self._count(profile.writer_partitions)):
            self.queue.push(self.rng.uniform(0.0, span), EventKind.WRITER_PARTITION, None)
        for _ in range(self._count(profile.writer_pauses)):
            self.queue.push(self.rng.uniform(0.0, span), EventKind.PAUSE, None)
        for _ in range(self.edges):
            self.queue.push(self.edge_rng.uniform(0.0, span), EventKind.EDGE_RESTART, None)
        for _ in range(self._count(profile.decode_crashes)):
            self.queue.push(self.rng.uniform(0.0, span), EventKind.DECODE_CRASH, self.rng.randrange(len(self.decode)))
        for _ in range(self._count(profile.quarantine_restarts)):
            writer = self.rng.randrange(len(self.prefill))
            self.queue.push(self.rng.uniform(0.0, span), EventKind.QUARANTINE_RESTART, writer)
        if profile.hostile_frames:
            count = max(1, round(profile.hostile_frames * 100))
            for _ in range(count):
                self.queue.push(self.rng.uniform(0.0, span), EventKind.HOSTILE, None)

    def _count(self, rate: float) -> int:
        """How many times a process fault happens in this seed: `rate` on average (see faults.py)."""
        whole = int(rate)
        return whole + (1 if rate > whole and self.rng.random() < rate - whole else 0)

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
        if node.endpoint is None:
            return
        if node.paused_until is not None:
            node.held.append(event)
            return
        self._handle(node, event)

    def _handle(self, node: Node, event: Event) -> None:
        endpoint = node.endpoint
        assert endpoint is not None
        now = node.clock.read(self.queue.now)
        self.events += 1
        self.trace.record(self.queue.now, node.peer_id, EVENT, event)
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
        at = None if due is None else node.clock.when(due)
        if node.timer is not None:
            if at is not None and node.timer.time == max(at, self.queue.now) and not node.timer.cancelled:
                return
            self.queue.cancel(node.timer)
            node.timer = None
        if at is not None:
            node.timer = self.queue.push(at, EventKind.TICK, (node, node.session))

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
                pass  # frames: the endpoint drops them; writes: a one-sided transport cannot refuse them
            case RoomSucceeded():
                self._room_succeeded(node, action.room, action.aux)
            case RoomFailed():
                self._room_failed(node, action.room, action.reason)
            case _:
                assert_never(action)  # mypy names this line when an Action is added and not handled here

    # ---- control plane -----------------------------------------------------------------------------------------------

    def _send(self, node: Node, action: Send) -> None:
        envelope = action.envelope
        if node.side == "decode":
            self.checker.observe_decode_send(node, action.peer, envelope)
        if self.profile.hostile_frames:
            self._recent.append((node.peer_id, action.peer, envelope))
            if self._forgeries_armed and isinstance(envelope.body, Grant):
                self._forge_stale_chunk_ready(node.peer_id, action.peer, envelope.body)
        if self.profile.send_failure and self.rng.random() < self.profile.send_failure:
            self._complete(node, node.session, SendFailed(action.peer, envelope, "sim"), self.queue.now)
            return
        delivered = self.network.send(node.peer_id, action.peer, self.codec.encode(envelope))
        if node.side == "prefill":
            self.checker.observe_prefill_send(node, action.peer, envelope, delivered)

    def _on_deliver(self, payload: Delivery) -> None:
        node = self.nodes.get(payload.dst)
        if node is not None and node.endpoint is not None:
            self.feed(node, ReceivedFrame(payload.frame))

    def _on_hostile(self, _payload: None) -> None:
        """A hostile or confused peer: junk and forged frames, or a real frame it saw on the wire, replayed as is,
        from a stale incarnation, about a room its sender has no part in, or (armed here, sent at the next Grant)
        a ChunkReady in the writer's name with another grant's epoch."""
        self.checker.hostile_sent += 1
        kind = self.rng.randrange(5)
        if kind == 0 or not self._recent:
            names = sorted(self.nodes)
            node = self.nodes[self.rng.choice(names)]
            frame = hostile_frame(self.rng, self.codec, names, sorted(self.rooms))
            if node.endpoint is not None:
                self.feed(node, ReceivedFrame(frame))
            return
        if kind == 4:
            self._forgeries_armed += 1
            return
        src, dst, envelope = self._recent[self.rng.randrange(len(self._recent))]
        foreign = [r for r, s in self.rooms.items() if f"P{s.plan.prefill}." not in src]
        forged = forged_from(self.rng, envelope, kind, foreign)
        if forged is not None:
            self._deliver_forged(src, dst, forged)

    def _forge_stale_chunk_ready(self, decode: str, writer: str, grant: Grant) -> None:
        node = self.nodes.get(writer)
        if node is None or node.endpoint is None:
            return
        self._forgeries_armed -= 1
        envelope = stale_chunk_ready(writer, node.session, node.endpoint.epoch_towards(decode), grant)
        self._deliver_forged(writer, decode, envelope)

    def _deliver_forged(self, src: str, dst: str, envelope: Envelope) -> None:
        self.trace.record(self.queue.now, "hostile", "forges", f"as {src} to {dst}")
        frame = self.codec.encode(envelope)
        self.queue.push(self.queue.now + self.network.delay(), EventKind.DELIVER, Delivery(src, dst, frame))

    def _on_partition(self, _payload: None) -> None:
        names = sorted(self.nodes)
        side = frozenset(self.rng.sample(names, self.rng.randint(1, max(1, len(names) // 3))))
        length = self.rng.uniform(0.1, self.profile.partition_length)
        self.trace.record(self.queue.now, "world", "partition", f"{sorted(side)} for {length * 1000:.0f}ms")
        self.network.partition(Partition(side, self.queue.now + length))

    def _on_writer_partition(self, _payload: None) -> None:
        """One writer loses its control frames (both ways, or only in or only out); its data path stays up."""
        writer = self.rng.choice(sorted(name for name, node in self.nodes.items() if node.side == "prefill"))
        length = self.rng.uniform(0.3, 2.0) * self.config.timing.dead_after_s
        inbound, outbound = self.rng.choice(((True, True), (True, False), (False, True)))
        way = "both ways" if inbound and outbound else "inbound" if inbound else "outbound"
        self.trace.record(self.queue.now, "world", "writer partition", f"{writer} {way} for {length * 1000:.0f}ms")
        self.network.partition(Partition(frozenset({writer}), self.queue.now + length, False, inbound, outbound))

    def _on_pause_armed(self, _payload: None) -> None:
        writer = self.rng.choice(sorted(name for name, node in self.nodes.items() if node.side == "prefill"))
        self.nodes[writer].pause_armed = True

    def _on_edge_armed(self, _payload: None) -> None:
        writer = self.edge_rng.choice(sorted(name for name, node in self.nodes.items() if node.side == "prefill"))
        self.nodes[writer].edge_armed = True

    def _pause(self, node: Node) -> None:
        node.pause_armed = False
        self._stall(node, self.rng.uniform(0.3, 1.8) * self.config.timing.dead_after_s)

    def _stall_to_lease_edge(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        """FaultProfile.edge_restarts: the writer stalls until 0-20 ms (its clock) before its lease towards the
        write's decode rank runs out, posts the write (at least 0.9 x max_write_s long) as it resumes, and its
        instance crashes right after posting it (dataplane.py); decode hears nothing from it after the stall began."""
        endpoint = node.endpoint
        assert isinstance(endpoint, PrefillEndpoint)
        edge = endpoint.lease_until(action.peer) - self.edge_rng.uniform(0.0, 0.02)
        if edge <= node.clock.read(self.queue.now):
            return  # no lease left to stall through: armed for the next write
        node.edge_armed = False
        node.edge_post = True
        self._stall(node, node.clock.when(edge) - self.queue.now)

    def _stall(self, node: Node, length: float) -> None:
        node.paused_until = self.queue.now + length
        self.trace.record(self.queue.now, node.peer_id, "PAUSE", f"for {length * 1000:.0f}ms")
        self.queue.push(node.paused_until, EventKind.RESUME, (node, node.session))

    def _on_resume(self, payload: tuple[Node, int]) -> None:
        """The stalled writer runs again: it handles what reached it meanwhile, in order (its queued writes among
        them, lease checked now), then runs its timers."""
        node, session = payload
        if node.session != session:
            return
        self.trace.record(self.queue.now, node.peer_id, "RESUME", f"{len(node.held)} held")
        node.resumed_at = self.queue.now
        # still paused while it catches up: whatever its handling causes queues up behind what was held; like a
        # runtime's loop, it drains its inbox before its timers run (once, at the end)
        while node.held and node.endpoint is not None:
            item = node.held.pop(0)
            if isinstance(item, PendingPost):
                self._post_checked(item.node, item.action)
            elif not isinstance(item, Tick):
                self._handle(node, item)
        node.paused_until = None
        node.held.clear()
        self._reschedule_timer(node)

    def _on_complete(self, payload: tuple[Node, int, Event]) -> None:
        node, session, event = payload
        if node.session == session and node.endpoint is not None:
            self.feed(node, event)
