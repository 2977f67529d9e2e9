"""What every part of the simulated world shares: its state, and the few primitives each part calls.

Owns `WorldCore`, the base of `World`: the attributes the event loop (world.py), the engine models
(engines.py) and the data plane (dataplane.py) all read and change, the helpers they share (a node's ranks, a
room's id, scheduling a completion) and the hooks one part implements for the others (`feed`,
`_reschedule_timer` and `_pause` in world.py, `_crash_decode` and `_restart_writer` in engines.py).
World is one object made of these parts, so a test can override any step of any part in a subclass. The state
declared here is also what the checker reads (`WorldView` in invariants.py, with `now`).

Sits above the records and the checker (it imports them, they import nothing of the world) and below the parts.
Called by world.py, engines.py and dataplane.py.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

from kvstage.layout import KVLayout
from kvstage.protocol import Codec, Event, WriteDirect, WriteRegion
from kvstage.sim.clock import EventKind, EventQueue, NodeClock
from kvstage.sim.faults import FaultProfile
from kvstage.sim.invariants import Checker
from kvstage.sim.network import Network
from kvstage.sim.records import DecodeInstance, InflightWrite, Node, PrefillInstance, RoomState
from kvstage.sim.scenario import RoomPlan, Scenario, SimConfig
from kvstage.sim.trace import Trace


class WorldCore(ABC):
    """The shared state of one seeded run; see the module docstring."""

    seed: int
    config: SimConfig
    profile: FaultProfile
    rng: random.Random
    edge_rng: random.Random  # the timing-edge faults' own draws, so the other faults' draws stay as they were
    edges: int  # edge restarts in this run (FaultProfile.edge_restarts)
    queue: EventQueue
    scenario: Scenario
    network: Network
    trace: Trace
    codec: Codec
    layout: KVLayout
    payloads: bool
    checker: Checker
    events: int
    core_s: float
    steps: int
    last_deadline: float
    _sessions: int  # the last session id handed to a starting rank
    _tokens: int  # the last in-flight write id
    nodes: dict[str, Node]
    clocks: dict[str, NodeClock]  # by peer id: a restarted process keeps its host's clock
    writes: dict[int, InflightWrite]
    scatters: dict[tuple[str, int], set[int]]
    fences: dict[tuple[str, int], list[tuple[Node, int, int]]]
    rooms: dict[int, RoomState]
    prefill: list[PrefillInstance]
    decode: list[DecodeInstance]

    @abstractmethod
    def feed(self, node: Node, event: Event) -> None:
        """Hand `event` to `node`'s endpoint now and carry out the actions it returns (world.py)."""

    @abstractmethod
    def _reschedule_timer(self, node: Node) -> None:
        """Schedule `node`'s next Tick for its endpoint's `next_timer()` (world.py)."""

    @abstractmethod
    def _pause(self, node: Node) -> None:
        """Stall `node`'s process now, for longer than the peers' death timeout (world.py)."""

    @abstractmethod
    def _stall_to_lease_edge(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        """Stall `node` until just before its lease for `action` runs out, then restart its instance (world.py)."""

    @abstractmethod
    def _crash_decode(self, instance: DecodeInstance) -> None:
        """Crash every rank of a decode instance now; it restarts later with new sessions (engines.py)."""

    @abstractmethod
    def _restart_writer(self, instance: PrefillInstance, *, at_once: bool = False) -> None:
        """Crash a prefill instance now (`at_once`: before anything else, even what happens at this same time); it
        restarts soon with a new session (engines.py)."""

    @property
    def now(self) -> float:
        """The true (virtual) time of the world: what the checker reads."""
        return self.queue.now

    def _complete(self, node: Node, session: int, event: Event, at: float) -> None:
        self.queue.push(at, EventKind.COMPLETE, (node, session, event))

    @staticmethod
    def _room_id(plan: RoomPlan) -> int:
        return int(plan.room[1:])

    def _decode_nodes(self, instance: int) -> list[Node]:
        return [self.nodes[f"D{instance}.{r}"] for r in range(self.decode[instance].tp)]

    def _prefill_nodes(self, instance: int) -> list[Node]:
        return [self.nodes[f"P{instance}.{r}"] for r in range(self.prefill[instance].tp)]
