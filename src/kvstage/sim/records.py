"""The records and the timing model of the simulated world: nodes, in-flight writes, rooms, engine instances.

Owns the constants of virtual time (how long a forward pass, a write, a scatter and a room's generation take)
and the mutable records the world keeps: `Node` (one rank), `InflightWrite`, `RoomState` (the sim's own view of
a room on both sides), `PrefillInstance` / `DecodeInstance` (the engine models' queues), `Violation` (what the
checker found) and `RunResult`.

Pure data, below the checker and the world: it imports only clock.py, memory.py and scenario.py of the
simulator, never the checker or the world. Called by the checker (invariants.py), the world's parts (core.py,
engines.py, dataplane.py, world.py) and runner.py.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvstage.protocol import DecodeEndpoint, Event, PrefillEndpoint, WriteDirect, WriteRegion
from kvstage.ring import StagingRing
from kvstage.sim.clock import NodeClock, Scheduled
from kvstage.sim.memory import KVMemory, PagePool, StagingMemory, Words
from kvstage.sim.scenario import SIM_TIMING, RoomPlan

#: Virtual seconds of one prefill forward pass, and per computed token.
FORWARD_S = 0.002
FORWARD_PER_TOKEN_S = 0.00005
#: Virtual seconds a bulk write takes, and per byte; a scatter; a decode room's generation after success.
WRITE_S = 0.001
WRITE_PER_BYTE_S = 1e-8
SCATTER_S = 0.0005
GENERATE_S = 0.02
#: Mean virtual seconds between an endpoint asking for a write and the runtime posting it (gather, queueing).
POST_MEAN_S = 0.0005
#: Rooms one prefill forward pass computes at once.
BATCH = 2
#: A run that has not quiesced this long after the last deadline is stuck (Q1).
DRAIN_S = 3 * SIM_TIMING.dead_after_s
#: Hard cap on world events per run: a protocol that keeps itself busy forever is a liveness bug.
MAX_STEPS = 2_000_000


@dataclass(frozen=True, slots=True)
class Violation:
    """An invariant the checker found broken (invariants.py), when, and how."""

    invariant: str
    time: float
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant} at {self.time * 1000:.3f}ms: {self.detail}"


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
    clock: NodeClock = field(default_factory=NodeClock)
    paused_until: float | None = None
    """While set, the node's process is stalled: what reaches it is held until it resumes."""
    held: list[Event | PendingPost] = field(default_factory=list)
    resumed_at: float | None = None
    pause_armed: bool = False
    """The node stalls right after it next asks for a write (FaultProfile.writer_pauses)."""
    edge_armed: bool = False
    """The node stalls until its lease's edge right after it next asks for a write (FaultProfile.edge_restarts)."""
    edge_post: bool = False
    """Its next posted write takes 0.9-1 x max_write_s (the write of an edge restart)."""


@dataclass(frozen=True, slots=True)
class PendingPost:
    """A write an endpoint asked for, not yet posted to the transport (the runtime gathers and queues it)."""

    node: Node
    session: int
    action: WriteRegion | WriteDirect


@dataclass(slots=True)
class InflightWrite:
    """A bulk or direct write between posting and landing."""

    writer: Node
    session: int
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
    decode_lost: bool = False
    """The decode instance crashed while it held the room: the room ended there with the process."""

    OK = "ok"
    DECODE_CRASHED = "decode crashed"

    @property
    def decode_done(self) -> bool:
        return (
            self.engine_failure is not None
            or self.decode_lost
            or (self.decode_admitted and len(self.decode_outcome) == len(self.decode_pages))
        )

    @property
    def succeeded(self) -> bool:
        return (
            self.engine_failure is None
            and not self.decode_lost
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
    restart_armed: bool = False
    """The instance crashes right after it next posts a write, made slow (FaultProfile.quarantine_restarts)."""


@dataclass(slots=True)
class DecodeInstance:
    index: int
    tp: int
    waiting: deque[int] = field(default_factory=deque)
    up: bool = True
    crash_armed: bool = False
    """The instance crashes right after the next write to it is posted (FaultProfile.decode_crashes)."""


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
