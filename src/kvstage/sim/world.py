"""The simulated world: real protocol endpoints driven by seeded engines, a faulty network and checked memory.

Owns `World`, which plays one seeded run: it builds the prefill and decode instances of a `Scenario` (one
`PrefillEndpoint` / `DecodeEndpoint` per rank, the real ones from kvstage.protocol), feeds them engine calls,
frames, completions and timer ticks in virtual time, and carries out every action they return:

- `Send`: encoded with the real codec and handed to the `Network` (loss, duplication, delay, partitions);
- `WriteRegion` / `WriteDirect`: gathered from the prefill rank's KV memory when issued, landing later in the
  decode rank's staging bytes or KV pages (or failing, or dropped when the writer is fenced);
- `Scatter` / `FenceScatter`: copied from staging into decode KV pages on completion;
- `FreePages`, `RoomSucceeded`, `RoomFailed`, `FencePeer`: applied to the engines' pools and the fence table.

The engines model what matters for liveness: decode admits rooms FIFO when its KV pool has pages; prefill
computes an admitted room only once decode has admitted it (the bootstrap), in chunked forward passes in
arrival order, limited by its own KV pool (R11); rooms are aborted from either side; prefill instances crash
and restart with a new session id.

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
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, assert_never

import numpy as np

from kvstage.layout import heads_of_rank, pages_for
from kvstage.protocol import (
    AbortRoom,
    AttachRoom,
    Codec,
    Completion,
    ComputeScheduled,
    DecodeConfig,
    DecodeEndpoint,
    Event,
    ExpectRoom,
    FencePeer,
    FenceScatter,
    FreePages,
    KVReady,
    PrefillConfig,
    PrefillEndpoint,
    ReceivedFrame,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    SendFailed,
    Tick,
    Timing,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.actions import Action
from kvstage.ring import StagingRing
from kvstage.sim.clock import EventQueue, Scheduled
from kvstage.sim.faults import FaultProfile
from kvstage.sim.hostile import hostile_frame
from kvstage.sim.invariants import Checker, Violation
from kvstage.sim.memory import KVMemory, PagePool, StagingMemory, TrackedRing, Words, expected_kv
from kvstage.sim.network import Delivery, Network
from kvstage.sim.scenario import RoomPlan, Scenario, SimConfig, make_scenario
from kvstage.sim.trace import ACTION, EVENT, Trace, describe

#: Protocol timing in the simulated world: fast enough that runs are short, slow enough that delays matter.
SIM_TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, retry_initial_s=0.02, retry_max_s=0.25)
#: Virtual seconds of one prefill forward pass, and per computed token.
FORWARD_S = 0.002
FORWARD_PER_TOKEN_S = 0.00005
#: Virtual seconds a bulk write takes, and per byte; a scatter; a decode room's generation after success.
WRITE_S = 0.001
WRITE_PER_BYTE_S = 1e-8
SCATTER_S = 0.0005
GENERATE_S = 0.02
#: Rooms one prefill forward pass computes at once.
BATCH = 2
#: A run that has not quiesced this long after the last deadline is stuck (Q1).
DRAIN_S = 3 * SIM_TIMING.dead_after_s
#: Hard cap on world events per run: a protocol that keeps itself busy forever is a liveness bug.
MAX_STEPS = 2_000_000


@dataclass(slots=True)
class Node:
    """One rank: its endpoint (None while its process is down), memory and timer."""

    peer_id: str
    side: str
    instance: int
    rank: int
    tp: int
    endpoint: DecodeEndpoint | PrefillEndpoint | None = None
    session: int = 0
    timer: Scheduled | None = None
    kv: KVMemory | None = None
    pool: PagePool | None = None
    staging: StagingMemory | None = None
    ring: StagingRing | None = None
    fenced: dict[str, tuple[int, int]] = field(default_factory=dict)
    """decode: the newest fenced incarnation of each prefill peer; its writes never land."""


@dataclass(slots=True)
class InflightWrite:
    """A bulk or direct write between issue and landing."""

    writer: Node
    session: int
    incarnation: tuple[int, int]
    target: Node
    action: WriteRegion | WriteDirect
    payload: bytes | Words | None
    """What the write carries (gathered when issued): staging bytes, or KV words on the direct path."""
    ok: bool


@dataclass(slots=True)
class RoomState:
    """The sim's own record of one room, on both sides."""

    plan: RoomPlan
    decode_pages: dict[int, tuple[int, ...]] = field(default_factory=dict)
    decode_registered: set[int] = field(default_factory=set)
    """Decode ranks that were handed the room (ExpectRoom)."""
    prefill_attached: set[int] = field(default_factory=set)
    """Prefill ranks of the current incarnation that were handed the room (AttachRoom)."""
    decode_outcome: dict[int, str] = field(default_factory=dict)
    prefill_outcome: dict[int, str] = field(default_factory=dict)
    prefill_pages: tuple[int, ...] | None = None
    prefill_session: int = 0
    """Incarnation of the prefill instance the room is attached to; 0 = not attached (yet)."""
    prefill_lost: bool = False
    decode_admitted: bool = False
    engine_failure: str | None = None
    """Set when an engine gave up on the room before the protocol saw it (never admitted)."""
    computed: int = 0
    first_failure: str | None = None
    """The first failure reason reported anywhere (either side, or an engine): the root cause."""
    pages_freed: bool = False

    OK = "ok"

    @property
    def decode_done(self) -> bool:
        return self.engine_failure is not None or (
            self.decode_admitted and len(self.decode_outcome) == len(self.decode_pages)
        )

    @property
    def succeeded(self) -> bool:
        return (
            self.engine_failure is None
            and self.decode_admitted
            and all(v == self.OK for v in self.decode_outcome.values())
            and len(self.decode_outcome) == len(self.decode_pages)
        )

    def failure_reason(self) -> str:
        if self.first_failure is not None:
            return self.first_failure
        reasons = [v for v in self.decode_outcome.values() if v != self.OK]
        return reasons[0] if reasons else "unknown"


@dataclass(slots=True)
class PrefillInstance:
    index: int
    tp: int
    forward_tokens: int
    session: int = 0
    up: bool = True
    pool: PagePool | None = None
    waiting: deque[int] = field(default_factory=deque)
    """Rooms attached and admitted by decode, waiting for prefill KV pages (FIFO)."""
    active: list[int] = field(default_factory=list)
    """Rooms holding pages and not yet fully computed."""
    holding: set[int] = field(default_factory=set)
    """Rooms holding prefill pages (computing or handing off)."""
    busy: bool = False
    deferred: list[int] = field(default_factory=list)
    """Rooms that arrived while the instance was down."""


@dataclass(slots=True)
class DecodeInstance:
    index: int
    tp: int
    waiting: deque[int] = field(default_factory=deque)


@dataclass(slots=True)
class RunResult:
    seed: int
    rooms: int
    succeeded: int
    failed_by_reason: Counter[str]
    violations: list[Violation]
    events: int
    steps: int
    wall_s: float
    cpu_s: float
    """CPU seconds of the whole run (process time: a loaded machine does not inflate it)."""
    core_s: float
    """CPU seconds inside endpoint calls: their wall time scaled by the run's CPU/wall ratio."""
    trace: list[str]
    digest: str | None = None


class World:
    """One seeded run; `run()` plays it to quiescence (or the first violation) and returns the result."""

    def __init__(self, seed: int, config: SimConfig, *, keep_trace: bool = False) -> None:
        self.seed = seed
        self.config = config
        self.profile: FaultProfile = config.profile
        self.rng = random.Random(seed)
        self.queue = EventQueue()
        self.scenario: Scenario = make_scenario(self.rng, config)
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
        self.nodes: dict[str, Node] = {}
        self.writes: dict[int, InflightWrite] = {}
        self.scatters: dict[tuple[str, int], set[int]] = {}
        self.fences: dict[tuple[str, int], list[tuple[Node, int, int]]] = {}
        self.rooms: dict[int, RoomState] = {}
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
        self._handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._on_arrive,
            "deliver": self._on_deliver,
            "tick": self._on_tick,
            "land": self._on_land,
            "complete": self._on_complete,
            "scatter": self._on_scatter_done,
            "forward": self._on_forward_done,
            "abort": self._on_abort,
            "expire": self._on_expire,
            "generated": self._on_generated,
            "crash": self._on_crash,
            "restart": self._on_restart,
            "partition": self._on_partition,
            "hostile": self._on_hostile,
        }

    # ---- construction -----------------------------------------------------------------------------------------

    def _next_session(self) -> int:
        self._sessions += 1
        return self._sessions

    def _build_decode(self, instance: DecodeInstance) -> None:
        ring_bytes = self.scenario.ring_bytes[instance.index]
        heads = len(heads_of_rank(self.layout.num_kv_heads, instance.tp, 0))
        for rank in range(instance.tp):
            peer_id = f"D{instance.index}.{rank}"
            staging = StagingMemory(ring_bytes, self.payloads)
            ring = TrackedRing(ring_bytes, staging)
            config = DecodeConfig(
                peer_id=peer_id,
                layout=self.layout,
                tp_size=instance.tp,
                rank=rank,
                chunk_tokens=self.config.chunk_tokens,
                ring_bytes=ring_bytes,
                attention=self.scenario.topology.attention,
                timing=SIM_TIMING,
            )
            node = Node(peer_id, "decode", instance.index, rank, instance.tp)
            node.session = self._next_session()
            node.ring = ring
            node.endpoint = DecodeEndpoint(config, node.session, ring=ring, codec=self.codec)
            node.pool = PagePool(peer_id, self.scenario.decode_pages)
            node.staging = staging
            if self.payloads:
                node.kv = self._kv_memory(self.scenario.decode_pages, heads)
            self.nodes[peer_id] = node

    def _kv_memory(self, pages: int, heads: int) -> KVMemory:
        layout = self.layout
        return KVMemory(pages, layout.page_size, layout.num_layers, heads, layout.head_dim)

    def _start_prefill(self, instance: PrefillInstance) -> None:
        """(Re)start every rank of a prefill instance with a fresh session, empty pool and empty memory."""
        instance.session = self._next_session()
        instance.up = True
        instance.pool = PagePool(f"P{instance.index}", self.scenario.prefill_pages)
        heads = len(heads_of_rank(self.layout.num_kv_heads, instance.tp, 0))
        for rank in range(instance.tp):
            peer_id = f"P{instance.index}.{rank}"
            config = PrefillConfig(
                peer_id=peer_id, layout=self.layout, tp_size=instance.tp, rank=rank, timing=SIM_TIMING
            )
            node = Node(peer_id, "prefill", instance.index, rank, instance.tp)
            node.session = instance.session
            node.endpoint = PrefillEndpoint(config, node.session, codec=self.codec)
            node.pool = instance.pool
            if self.payloads:
                node.kv = self._kv_memory(self.scenario.prefill_pages, heads)
            self.nodes[peer_id] = node
            self._reschedule_timer(node)

    def _schedule_scenario(self) -> None:
        profile = self.profile
        last_arrival = 0.0
        for plan in self.scenario.rooms:
            self.rooms[self._room_id(plan)] = RoomState(plan)
            self.queue.push(plan.arrival, "arrive", self._room_id(plan))
            if plan.abort_at is not None:
                self.queue.push(plan.abort_at, "abort", self._room_id(plan))
            last_arrival = plan.arrival
        self.last_deadline = max(plan.deadline for plan in self.scenario.rooms)
        span = last_arrival + 0.2
        for _ in range(profile.prefill_crashes):
            self.queue.push(self.rng.uniform(0.0, span), "crash", self.rng.randrange(len(self.prefill)))
        for _ in range(profile.partitions):
            self.queue.push(self.rng.uniform(0.0, span), "partition", None)
        if profile.hostile_frames:
            count = max(1, round(profile.hostile_frames * 100))
            for _ in range(count):
                self.queue.push(self.rng.uniform(0.0, span), "hostile", None)

    @staticmethod
    def _room_id(plan: RoomPlan) -> int:
        return int(plan.room[1:])

    # ---- the main loop ----------------------------------------------------------------------------------------

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
        return not any(entry.kind in ("deliver", "complete", "scatter", "land") for entry in self.queue.pending())

    # ---- feeding endpoints ------------------------------------------------------------------------------------

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
            node.timer = self.queue.push(due, "tick", (node, node.session))

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

    # ---- control plane ----------------------------------------------------------------------------------------

    def _send(self, node: Node, action: Send) -> None:
        envelope = action.envelope
        if node.side == "decode":
            self.checker.observe_decode_send(node, envelope)
        if self.profile.send_failure and self.rng.random() < self.profile.send_failure:
            self.queue.push(self.queue.now, "complete", (node, node.session, SendFailed(action.peer, envelope, "sim")))
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

    def _complete(self, node: Node, session: int, event: Event, at: float) -> None:
        self.queue.push(at, "complete", (node, session, event))

    def _on_complete(self, payload: tuple[Node, int, Event]) -> None:
        node, session, event = payload
        if node.session == session and node.endpoint is not None:
            self.feed(node, event)

    # ---- data plane: writes -----------------------------------------------------------------------------------

    def _issue_write(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        target = self.nodes.get(action.peer)
        state = self.rooms.get(action.room)
        assert node.pool is not None
        self.checker.check_source_pages(node, action)
        if target is None or target.side != "decode" or state is None:
            self._complete(node, node.session, Completion(action.token, False, "no such decode peer"), self.queue.now)
            return
        payload = self._gather(node, action) if self.payloads else None
        nbytes = action.block.nbytes if isinstance(action, WriteRegion) else action.num_tokens
        at = self.queue.now + WRITE_S + nbytes * WRITE_PER_BYTE_S + self.network.delay()
        if self.profile.slow_writes and self.rng.random() < self.profile.slow_writes:
            at += self.rng.uniform(0.01, 0.06)
        if self.network.cut(node.peer_id, target.peer_id, self.queue.now):
            self._complete(node, node.session, Completion(action.token, False, "partitioned"), at)
            return
        ok = not (self.profile.write_failure and self.rng.random() < self.profile.write_failure)
        incarnation = (action.writer_session, action.writer_epoch)
        self._tokens += 1
        self.writes[self._tokens] = InflightWrite(node, node.session, incarnation, target, action, payload, ok)
        self.queue.push(at, "land", self._tokens)

    def _gather(self, node: Node, action: WriteRegion | WriteDirect) -> bytes | Words:
        assert node.kv is not None
        transfer = action.block.transfer if isinstance(action, WriteRegion) else action.transfer
        values = node.kv.read(action.src_pages, 0, action.num_tokens, transfer.src_head_start, transfer.num_heads)
        return values.tobytes() if isinstance(action, WriteRegion) else values

    def _on_land(self, payload: int) -> None:
        write = self.writes.pop(payload)
        target, action = write.target, write.action
        fenced = target.fenced.get(write.writer.peer_id)
        if fenced is not None and write.incarnation <= fenced:
            self.trace.record(self.queue.now, target.peer_id, "write dropped", f"fenced {describe(action)}")
            self._complete(write.writer, write.session, Completion(action.token, False, "fenced"), self.queue.now)
            return
        self.trace.record(self.queue.now, target.peer_id, "write lands", action)
        if isinstance(action, WriteRegion):
            self.checker.check_region_write(target, action)
            if self.payloads and target.staging is not None:
                data = write.payload
                assert isinstance(data, bytes)
                target.staging.write(action.dst_offset, data if write.ok else data[: len(data) // 2])
        else:
            self.checker.check_direct_write(target, action)
            if self.payloads and target.kv is not None and write.ok:
                assert isinstance(write.payload, np.ndarray)
                target.kv.write(action.dst_pages, 0, action.transfer.dst_head_start, write.payload)
        reason = "" if write.ok else "simulated transfer failure"
        self._complete(write.writer, write.session, Completion(action.token, write.ok, reason), self.queue.now)

    # ---- data plane: scatters and fences ----------------------------------------------------------------------

    def _issue_scatter(self, node: Node, action: Scatter) -> None:
        self.scatters.setdefault((node.peer_id, action.room), set()).add(action.token)
        self.queue.push(self.queue.now + SCATTER_S, "scatter", (node, node.session, action))

    def _on_scatter_done(self, payload: tuple[Node, int, Scatter]) -> None:
        node, session, action = payload
        if node.session != session:
            return
        ok = not (self.profile.scatter_failure and self.rng.random() < self.profile.scatter_failure)
        self.checker.check_scatter(node, action)
        if ok and self.payloads:
            self._scatter_bytes(node, action)
        key = (node.peer_id, action.room)
        self.scatters[key].discard(action.token)
        self.feed(node, Completion(action.token, ok, "" if ok else "simulated scatter failure"))
        if not self.scatters[key]:
            del self.scatters[key]
            for waiter, waiter_session, token in self.fences.pop(key, []):
                self._complete(waiter, waiter_session, Completion(token), self.queue.now)

    def _scatter_bytes(self, node: Node, action: Scatter) -> None:
        """Into the room's pages at the Scatter's token range, as production scatters into the room's slots."""
        assert node.staging is not None and node.kv is not None
        layout = self.layout
        pages = self.rooms[action.room].decode_pages[node.rank]
        for block in action.plan.blocks:
            raw = node.staging.read(action.region.offset + block.offset, block.nbytes)
            shape = (2, layout.num_layers, action.num_tokens, block.transfer.num_heads, layout.head_dim)
            node.kv.write(pages, action.token_start, block.transfer.dst_head_start, _words(raw).reshape(shape))

    def _issue_fence(self, node: Node, action: FenceScatter) -> None:
        key = (node.peer_id, action.room)
        if self.scatters.get(key):
            self.fences.setdefault(key, []).append((node, node.session, action.token))
        else:
            self._complete(node, node.session, Completion(action.token), self.queue.now)

    def _fence_peer(self, node: Node, action: FencePeer) -> None:
        if node.side == "decode":
            fenced = (action.session, action.epoch)
            node.fenced[action.peer] = max(node.fenced.get(action.peer, fenced), fenced)

    # ---- engines: arrival and admission -----------------------------------------------------------------------

    def _on_arrive(self, room: int) -> None:
        state = self.rooms[room]
        self.decode[state.plan.decode].waiting.append(room)
        self.queue.push(state.plan.deadline, "expire", room)
        self._admit_decode(self.decode[state.plan.decode])
        self._attach_prefill(room)

    def _admit_decode(self, instance: DecodeInstance) -> None:
        """Admit waiting rooms FIFO while every rank's pool has pages for the next one."""
        while instance.waiting:
            room = instance.waiting[0]
            state = self.rooms[room]
            if state.engine_failure is not None:
                instance.waiting.popleft()
                continue
            nodes = self._decode_nodes(instance.index)
            count = pages_for(state.plan.num_tokens, self.layout.page_size)
            if any(n.pool is None or n.pool.free_count < count for n in nodes):
                return
            instance.waiting.popleft()
            self._admit_decode_room(room, nodes, count)

    def _admit_decode_room(self, room: int, nodes: list[Node], count: int) -> None:
        state = self.rooms[room]
        plan = state.plan
        state.decode_admitted = True
        prefill = self.prefill[plan.prefill]
        peers = tuple(f"P{prefill.index}.{r}" for r in range(prefill.tp))
        for node in nodes:
            assert node.pool is not None
            pages = node.pool.allocate(count, str(room))
            assert pages is not None
            state.decode_pages[node.rank] = pages
            if self.payloads and plan.prefix_tokens and node.kv is not None:
                heads = heads_of_rank(self.layout.num_kv_heads, node.tp, node.rank)
                cached = expected_kv(
                    plan.key, 0, plan.prefix_tokens, heads, self.layout.num_layers, self.layout.head_dim
                )
                node.kv.write(pages, 0, 0, cached)
        for node in nodes:
            event = ExpectRoom(
                room, peers, plan.num_tokens, plan.prefix_tokens, state.decode_pages[node.rank], plan.deadline
            )
            state.decode_registered.add(node.rank)
            self.feed(node, event)
        if any(outcome != RoomState.OK for outcome in state.decode_outcome.values()):
            self._abort_ranks(nodes, state.decode_registered, state.decode_outcome, room)
        if state.prefill_session and not state.prefill_lost:
            prefill.waiting.append(room)
            self._admit_prefill(prefill)

    def _attach_prefill(self, room: int) -> None:
        state = self.rooms[room]
        instance = self.prefill[state.plan.prefill]
        if not instance.up:
            instance.deferred.append(room)
            return
        state.prefill_session = instance.session
        decode_tp = self.decode[state.plan.decode].tp
        nodes = self._prefill_nodes(instance.index)
        for node in nodes:
            state.prefill_attached.add(node.rank)
            self.feed(node, AttachRoom(room, state.plan.num_tokens, decode_tp, state.plan.deadline))
        if any(outcome != RoomState.OK for outcome in state.prefill_outcome.values()):
            self._abort_ranks(nodes, state.prefill_attached, state.prefill_outcome, room)
        if state.decode_admitted and not self._prefill_done(state):
            instance.waiting.append(room)
            self._admit_prefill(instance)

    def _admit_prefill(self, instance: PrefillInstance) -> None:
        """Give waiting rooms prefill KV pages FIFO, then keep the forward loop running."""
        while instance.waiting and instance.up:
            room = instance.waiting[0]
            state = self.rooms[room]
            if self._prefill_done(state) or state.prefill_session != instance.session:
                instance.waiting.popleft()
                continue
            assert instance.pool is not None
            pages = instance.pool.allocate(pages_for(state.plan.num_tokens, self.layout.page_size), str(room))
            if pages is None:
                break
            instance.waiting.popleft()
            state.prefill_pages = pages
            instance.active.append(room)
            instance.holding.add(room)
        self._forward(instance)

    def _forward(self, instance: PrefillInstance) -> None:
        """Start the next forward pass: the next slice of up to BATCH active rooms, in admission order (R11)."""
        if instance.busy or not instance.up:
            return
        batch = [r for r in instance.active if not self._prefill_done(self.rooms[r])][:BATCH]
        if not batch:
            return
        instance.busy = True
        work: list[tuple[int, int]] = []
        total = 0
        for room in batch:
            state = self.rooms[room]
            end = min(state.computed + instance.forward_tokens, state.plan.num_tokens)
            work.append((room, end))
            total += end - state.computed
            for node in self._prefill_nodes(instance.index):
                self.feed(node, ComputeScheduled(room, end))
        at = self.queue.now + FORWARD_S + total * FORWARD_PER_TOKEN_S
        self.queue.push(at, "forward", (instance, instance.session, tuple(work)))

    def _on_forward_done(self, payload: tuple[PrefillInstance, int, tuple[tuple[int, int], ...]]) -> None:
        instance, session, work = payload
        if instance.session != session:
            return
        instance.busy = False
        for room, end in work:
            state = self.rooms[room]
            if self._prefill_done(state) or state.prefill_pages is None:
                continue
            self._compute_kv(instance, state, end)
            state.computed = end
            if end >= state.plan.num_tokens:
                instance.active.remove(room)
            for node in self._prefill_nodes(instance.index):
                self.feed(node, KVReady(room, end, state.prefill_pages))
        self._forward(instance)

    def _compute_kv(self, instance: PrefillInstance, state: RoomState, end: int) -> None:
        if not self.payloads:
            return
        assert state.prefill_pages is not None
        layout = self.layout
        for node in self._prefill_nodes(instance.index):
            assert node.kv is not None
            heads = heads_of_rank(layout.num_kv_heads, instance.tp, node.rank)
            values = expected_kv(state.plan.key, state.computed, end, heads, layout.num_layers, layout.head_dim)
            node.kv.write(state.prefill_pages, state.computed, 0, values)

    # ---- engines: outcomes ------------------------------------------------------------------------------------

    def _room_succeeded(self, node: Node, room: int) -> None:
        state = self.rooms.get(room)
        if state is None:
            return
        if node.side == "decode":
            self.checker.check_room_kv(node, state)
            state.decode_outcome[node.rank] = RoomState.OK
            self._decode_progress(state)
        else:
            state.prefill_outcome[node.rank] = RoomState.OK
            self._prefill_progress(state)

    def _room_failed(self, node: Node, room: int, reason: str) -> None:
        state = self.rooms.get(room)
        if state is None:
            return
        self.checker.check_reason(node, reason)
        if state.first_failure is None:
            state.first_failure = reason
        if node.side == "decode":
            state.decode_outcome[node.rank] = reason
            self._abort_ranks(
                self._decode_nodes(state.plan.decode), state.decode_registered, state.decode_outcome, room
            )
            self._decode_progress(state)
        else:
            state.prefill_outcome[node.rank] = reason
            nodes = self._prefill_nodes(state.plan.prefill)
            self._abort_ranks(nodes, state.prefill_attached, state.prefill_outcome, room)
            self._prefill_progress(state)

    def _abort_ranks(self, nodes: list[Node], handed: set[int], outcome: dict[int, str], room: int) -> None:
        """A room is one request: once one rank failed it, the engine aborts it on the ranks still running it."""
        for other in nodes:
            if other.rank in handed and other.rank not in outcome:
                self.feed(other, AbortRoom(room))

    def _decode_progress(self, state: RoomState) -> None:
        """Once every decode rank ended the room, the engine takes back the pages it still owns."""
        if not state.decode_done or state.pages_freed:
            return
        if state.succeeded:
            self.queue.push(self.queue.now + GENERATE_S, "generated", self._room_id(state.plan))
        else:
            self._release_engine_pages(state)

    def _on_generated(self, room: int) -> None:
        self._release_engine_pages(self.rooms[room])

    def _release_engine_pages(self, state: RoomState) -> None:
        """Return the pages of the ranks where the room succeeded (failed ranks return theirs by FreePages)."""
        state.pages_freed = True
        room = self._room_id(state.plan)
        for node in self._decode_nodes(state.plan.decode):
            if state.decode_outcome.get(node.rank) == RoomState.OK and node.pool is not None:
                foreign = node.pool.free(state.decode_pages[node.rank], str(room))
                if foreign:
                    self.checker.fail(
                        "S2", f"{node.peer_id}: engine freed pages {foreign} of room {room} it no longer held"
                    )
        self._admit_decode(self.decode[state.plan.decode])

    def _free_decode_pages(self, node: Node, action: FreePages) -> None:
        state = self.rooms.get(action.room)
        assert node.pool is not None
        if state is None or state.decode_pages.get(node.rank) != action.pages:
            self.checker.fail("S2", f"{node.peer_id}: FreePages of room {action.room} names pages it was not given")
            return
        foreign = node.pool.free(action.pages, str(action.room))
        if foreign:
            self.checker.fail("S2", f"{node.peer_id}: FreePages of room {action.room} freed pages {foreign} twice")
        self._admit_decode(self.decode[node.instance])

    def _prefill_progress(self, state: RoomState) -> None:
        """Once every prefill rank ended the room, its prefill pages go back to the pool."""
        instance = self.prefill[state.plan.prefill]
        if not self._prefill_done(state) or state.prefill_session != instance.session:
            return
        room = self._room_id(state.plan)
        if room in instance.active:
            instance.active.remove(room)
        if room in instance.holding:
            instance.holding.discard(room)
            assert instance.pool is not None and state.prefill_pages is not None
            instance.pool.free(state.prefill_pages, str(room))
            self._admit_prefill(instance)

    def _prefill_done(self, state: RoomState) -> bool:
        return state.prefill_lost or len(state.prefill_outcome) == self.prefill[state.plan.prefill].tp

    def _on_expire(self, room: int) -> None:
        """The decode engine gives up on a room still waiting for KV pages at its deadline."""
        state = self.rooms[room]
        if not state.decode_admitted and state.engine_failure is None:
            state.engine_failure = "timeout"
            state.first_failure = state.first_failure or "timeout"

    def _on_abort(self, room: int) -> None:
        state = self.rooms[room]
        if state.plan.abort_side == "decode":
            if not state.decode_admitted:
                state.engine_failure = "aborted by decode"
                state.first_failure = state.first_failure or "aborted by decode"
                return
            self._abort_ranks(
                self._decode_nodes(state.plan.decode), state.decode_registered, state.decode_outcome, room
            )
        elif state.prefill_session and not state.prefill_lost:
            nodes = self._prefill_nodes(state.plan.prefill)
            self._abort_ranks(nodes, state.prefill_attached, state.prefill_outcome, room)

    # ---- crashes ----------------------------------------------------------------------------------------------

    def _on_crash(self, index: int) -> None:
        instance = self.prefill[index]
        if not instance.up:
            return
        self.trace.record(self.queue.now, f"P{instance.index}", "CRASH", f"session {instance.session}")
        instance.up = False
        for node in self._prefill_nodes(instance.index):
            node.endpoint = None
            if node.timer is not None:
                self.queue.cancel(node.timer)
                node.timer = None
        for state in self.rooms.values():
            if state.plan.prefill == instance.index and state.prefill_session == instance.session:
                state.prefill_lost = True
        instance.waiting.clear()
        instance.active.clear()
        instance.holding.clear()
        instance.busy = False
        down = self.rng.uniform(0.05, 2 * SIM_TIMING.dead_after_s)
        self.queue.push(self.queue.now + down, "restart", instance.index)

    def _on_restart(self, index: int) -> None:
        instance = self.prefill[index]
        self._start_prefill(instance)
        self.trace.record(self.queue.now, f"P{instance.index}", "RESTART", f"session {instance.session}")
        deferred, instance.deferred = instance.deferred, []
        for room in deferred:
            self._attach_prefill(room)

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _decode_nodes(self, instance: int) -> list[Node]:
        return [self.nodes[f"D{instance}.{r}"] for r in range(self.decode[instance].tp)]

    def _prefill_nodes(self, instance: int) -> list[Node]:
        return [self.nodes[f"P{instance}.{r}"] for r in range(self.prefill[instance].tp)]


def _words(raw: bytes) -> Words:
    return np.frombuffer(raw, dtype=np.uint16)
