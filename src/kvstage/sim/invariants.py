"""The invariant checker of the simulator: W1, S1, S2, D1, L1, Q1 and B1 (docs/simulation.md, "Invariants").

Owns `Checker` and `WorldView`. The world calls the checker at every data operation (a write landing, a
scatter completing, pages being freed, a room succeeding) and after every step; the first violation stops the
run, and the runner prints the seed, the invariant and the trace tail.

- W1: every write that lands (bulk or direct, from a live, crashed or fenced writer alike) lands in space its
  (room, chunk) still holds since the grant: a ring region not freed since, or decode pages its room still
  holds. A late write into released space is the silent corruption leases exist to prevent.
- S1: a staged write lands inside its own region, within the ring, and never in bytes of an older live region of
  another (room, chunk) (the watermark). Region ownership is learnt from the decode ring itself (`TrackedRing`
  reports every allocate and free) and the Grants the endpoint sends.
- S2: a scatter reads only a region that is still live and owned by its (room, chunk), and writes only pages its
  room still holds; a write reads only prefill pages its room holds; pages are never freed twice or by someone
  who does not hold them.
- D1: when a decode rank reports success, the aux row it reports is the one prefill's engine gave with the room's
  completing KVReady, and its KV pages for the room equal, bit for bit, what prefill computed for its heads (the
  KV only with tensor payloads on).
- L1: every room ends (Succeeded or Failed with a known reason) on every rank that saw it, by its deadline
  (a rank whose process is stalled, or a prefill rank draining a write, is excused until that ends: both are
  bounded, by the pause and by max_write_s).
- Q1: at the end, rings are empty, every page is back, nothing is parked, nothing is in flight, and every
  endpoint is quiescent with no open room.
- B1: an endpoint only ever holds rooms the world created, and never more than that; hostile frames change
  nothing but counters.
- crash: an endpoint raised instead of answering an event (the world reports it like a violation).
- R2 (a protocol rule checked directly, because its breakage is otherwise masked by retries): a decode rank
  sends Metadata only for a room it has registered.
- R4 (checked directly, because a room whose notice is never retried still ends, by its deadline): a writer
  whose ChunkReady the network dropped sends it again within `retry_max_s` (plus a grace), unless the room
  ended on the writer, decode acknowledged the chunk meanwhile, or the writer is stalled or gone.

The checker reads the world through `WorldView`, the narrow read-only view it defines here (World satisfies it),
so it imports only the records below it (records.py) and never the world; the only thing it writes is its own
verdict line into the world's trace. Called by the world's parts only (world.py builds it; engines.py and
dataplane.py call its checks).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence, Set
from typing import Protocol

import numpy as np

from kvstage.layout import KVLayout, heads_of_rank, page_slice
from kvstage.protocol import DecodeEndpoint, PrefillEndpoint, WriteDirect, WriteRegion
from kvstage.protocol.actions import Scatter
from kvstage.protocol.messages import ChunkAck, ChunkReady, Envelope, Grant, Metadata
from kvstage.protocol.prefill import PrefillRoomState
from kvstage.protocol.reasons import FAILURE_REASONS
from kvstage.sim.memory import Owner, expected_aux, expected_kv
from kvstage.sim.records import InflightWrite, Node, PrefillInstance, RoomState, Violation
from kvstage.sim.scenario import SimConfig
from kvstage.sim.trace import Trace

#: Virtual seconds a room may stay open past its deadline before L1 is violated (one retry round).
DEADLINE_GRACE_S = 0.05


class WorldView(Protocol):
    """What the checker reads of one world (World is one): its time, setup, nodes, rooms and what is in flight."""

    @property
    def now(self) -> float:
        """The true (virtual) time of the world."""

    @property
    def trace(self) -> Trace:
        """The run's trace; the checker writes only its verdict line there."""

    @property
    def config(self) -> SimConfig: ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def payloads(self) -> bool:
        """Writes move real KV bytes (D1 is checked), not only ownership tags."""

    @property
    def nodes(self) -> Mapping[str, Node]: ...

    @property
    def rooms(self) -> Mapping[int, RoomState]: ...

    @property
    def prefill(self) -> Sequence[PrefillInstance]: ...

    @property
    def writes(self) -> Mapping[int, InflightWrite]:
        """Writes posted and not landed yet."""

    @property
    def scatters(self) -> Mapping[tuple[str, int], Set[int]]:
        """Scatters in flight, by (decode rank, room)."""

    @property
    def fences(self) -> Mapping[tuple[str, int], Sequence[tuple[Node, int, int]]]:
        """FenceScatters waiting for their room's scatters, by (decode rank, room)."""


class Checker:
    """Checks one world; `violations` holds at most one entry (the run stops at the first)."""

    def __init__(self, world: WorldView) -> None:
        self.world = world
        self.violations: list[Violation] = []
        self.hostile_sent = 0
        self._deadlines = sorted(
            (state.plan.deadline, state.plan.deadline, room) for room, state in world.rooms.items()
        )
        self._legit = frozenset(world.rooms)
        self._announced: set[tuple[str, int]] = set()
        # (writer, decode, room, chunk) -> by when a dropped ChunkReady must be sent again (R4), and the chunks
        # decode has acknowledged to a writer (nothing is owed for them any more)
        self._owed: dict[tuple[str, str, int, int], float] = {}
        self._acked: set[tuple[str, str, int, int]] = set()

    def fail(self, invariant: str, detail: str) -> None:
        if not self.violations:
            self.violations.append(Violation(invariant, self.world.now, detail))
            self.world.trace.record(self.world.now, "CHECK", f"VIOLATION {invariant}", detail)

    # ---- ownership of staging regions -------------------------------------------------------------------------

    def observe_decode_send(self, node: Node, peer: str, envelope: Envelope) -> None:
        """Label every ring region with the (room, chunk) of the Grant a decode rank sends for it, check R2: a
        decode rank announces (sends Metadata for) only a room it has registered, and note ChunkAcks (R4)."""
        body = envelope.body
        if isinstance(body, ChunkAck):
            key = (peer, node.peer_id, body.room, body.chunk)
            self._acked.add(key)
            self._owed.pop(key, None)
        elif isinstance(body, Grant) and body.end > body.offset and node.staging is not None:
            node.staging.label(body.epoch, str(body.room), body.chunk)
        elif isinstance(body, Metadata) and (node.peer_id, body.room) not in self._announced:
            # the first Metadata is the announcement (a retry may share a call with the room's failure)
            self._announced.add((node.peer_id, body.room))
            endpoint = node.endpoint
            assert isinstance(endpoint, DecodeEndpoint)
            if endpoint.room_state(body.room) is None:
                self.fail("R2", f"{node.peer_id} announced room {body.room} before registering it")

    def observe_prefill_send(self, node: Node, peer: str, envelope: Envelope, delivered: bool) -> None:
        """R4: a ChunkReady the network dropped is owed again; any ChunkReady sent pays what is owed."""
        body = envelope.body
        if isinstance(body, ChunkReady):
            key = (node.peer_id, peer, body.room, body.chunk)
            if delivered or key in self._acked:
                self._owed.pop(key, None)
            else:
                self._owed[key] = self.world.now + self.world.config.timing.retry_max_s + DEADLINE_GRACE_S

    def _check_retries(self, now: float) -> None:
        """R4 for every dropped ChunkReady whose retry is due."""
        for key, due in list(self._owed.items()):
            if due > now:
                continue
            writer, _, room, chunk = key
            node = self.world.nodes.get(writer)
            endpoint = None if node is None else node.endpoint
            if node is not None and self._stalled(node):
                continue
            del self._owed[key]
            if isinstance(endpoint, PrefillEndpoint) and endpoint.room_state(room) == PrefillRoomState.ACTIVE:
                self.fail("R4", f"{writer} never sent the dropped ChunkReady of room {room} chunk {chunk} again")
                return

    # ---- per data operation -----------------------------------------------------------------------------------

    def check_source_pages(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        assert node.pool is not None
        foreign = node.pool.foreign_pages(action.src_pages, str(action.room))
        if foreign:
            self.fail(
                "S2",
                f"{node.peer_id} writes room {action.room} chunk {action.chunk} from pages {foreign} it does not hold",
            )

    def check_landing(self, target: Node, action: WriteRegion | WriteDirect) -> None:
        """W1 on every landing, then S1 for staged writes."""
        if isinstance(action, WriteDirect):
            assert target.pool is not None
            foreign = target.pool.foreign_pages(action.dst_pages, str(action.room))
            if foreign:
                self.fail(
                    "W1",
                    f"{target.peer_id}: direct write of room {action.room} chunk {action.chunk} lands in pages "
                    f"{foreign} its room no longer holds",
                )
            return
        assert target.staging is not None
        start, end = action.dst_offset, action.dst_offset + action.block.nbytes
        where = f"{target.peer_id}: write of room {action.room} chunk {action.chunk} (e{action.region.epoch})"
        mine = target.staging.owner(action.region.epoch)
        if mine is None or (mine.room, mine.chunk) != (str(action.room), action.chunk):
            clash = target.staging.overlapping(start, end, str(action.room), action.chunk)
            victim = (
                f", into live region e{clash[0].epoch} of room {clash[0].room} chunk {clash[0].chunk}" if clash else ""
            )
            self.fail("W1", f"{where} lands in [{start},{end}) after its region was freed{victim}")
            return
        self._check_region_write(target, action, mine)

    def _check_region_write(self, target: Node, action: WriteRegion, mine: Owner) -> None:
        """S1. Bytes of an over-committed ring belong to the oldest live allocation covering them. A write must land
        inside its own live region and may overlap only newer regions there (they wait for it)."""
        assert target.staging is not None
        start, end = action.dst_offset, action.dst_offset + action.block.nbytes
        where = f"{target.peer_id}: write of room {action.room} chunk {action.chunk} (e{action.region.epoch})"
        if end > target.staging.capacity_bytes:
            self.fail("S1", f"{where} to [{start},{end}) overruns the ring")
            return
        if not (mine.offset <= start and end <= mine.end):
            self.fail("S1", f"{where} to [{start},{end}) lands outside its region [{mine.offset},{mine.end})")
            return
        older = [
            o for o in target.staging.overlapping(start, end, str(action.room), action.chunk) if o.epoch < mine.epoch
        ]
        if older:
            other = older[0]
            self.fail(
                "S1",
                f"{where} to [{start},{end}) lands in older live region e{other.epoch}[{other.offset},{other.end}) "
                f"of room {other.room} chunk {other.chunk}: the writer ignored the watermark",
            )

    def check_scatter(self, node: Node, action: Scatter) -> None:
        assert node.staging is not None and node.pool is not None
        owner = node.staging.owner(action.region.epoch)
        if owner is None or (owner.room, owner.chunk) != (str(action.room), action.chunk):
            self.fail(
                "S2",
                f"{node.peer_id}: scatter of room {action.room} chunk {action.chunk} reads region "
                f"e{action.region.epoch}[{action.region.offset},{action.region.end}) that is "
                + ("freed" if owner is None else f"owned by room {owner.room} chunk {owner.chunk}"),
            )
            return
        room_pages = self.world.rooms[action.room].decode_pages[node.rank]
        pages = room_pages[page_slice(action.token_start, action.token_end, self.world.layout.page_size)]
        foreign = node.pool.foreign_pages(pages, str(action.room))
        if foreign:
            self.fail("S2", f"{node.peer_id}: scatter of room {action.room} writes pages {foreign} it released")

    def check_room_kv(self, node: Node, state: RoomState, aux: bytes) -> None:
        """D1: the decode rank reports the aux row prefill gave, and its pages hold exactly what prefill computed
        for its heads."""
        world = self.world
        if aux != expected_aux(state.plan.key):
            self.fail("D1", f"{node.peer_id}: room {state.plan.room[1:]} succeeded with aux row {aux[:40]!r}")
            return
        if not world.payloads or node.kv is None:
            return
        plan, layout = state.plan, world.layout
        pages = state.decode_pages[node.rank]
        heads = heads_of_rank(layout.num_kv_heads, node.tp, node.rank)
        got = node.kv.read(pages, 0, plan.num_tokens, 0, len(heads))
        want = expected_kv(plan.key, 0, plan.num_tokens, heads, layout.num_layers, layout.head_dim)
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)
            kv, layer, token, head = (int(x) for x in bad[0][:4])
            self.fail(
                "D1",
                f"{node.peer_id}: room {plan.room[1:]} succeeded but {len(bad)} KV words differ, first at "
                f"{'KV'[kv]} layer {layer} token {token} local head {head}",
            )

    def check_reason(self, node: Node, reason: str) -> None:
        if reason not in FAILURE_REASONS:
            self.fail("L1", f"{node.peer_id} failed a room with unknown reason {reason!r}")

    # ---- after every step -------------------------------------------------------------------------------------

    def after_feed(self, node: Node) -> None:
        """B1 on the endpoint just fed: it holds only rooms the world created, and parks a bounded number; and the
        timer half of Q1, checked at every step: no retry or deadline is pending for a room it forgot."""
        endpoint = node.endpoint
        if endpoint is None:
            return
        rooms = endpoint.open_rooms()
        stray = rooms - self._legit
        if stray:
            self.fail("B1", f"{node.peer_id} holds state for rooms {sorted(stray)[:4]} that the world never created")
        # (prefill keeps a ttl timer for metadata of rooms its engine has not attached yet, outside open_rooms())
        dead = endpoint.rooms_with_timers() - rooms if node.side == "decode" else frozenset()
        if dead:
            self.fail("Q1", f"{node.peer_id} keeps a retry or deadline timer for forgotten rooms {sorted(dead)[:4]}")
        if isinstance(endpoint, PrefillEndpoint):
            limit = len(self._legit) * endpoint.config.limits.max_chunks_ahead * len(self.world.nodes)
            if endpoint.parked_count() > limit:
                self.fail("B1", f"{node.peer_id} parks {endpoint.parked_count()} chunks, more than {limit}")

    def after_step(self) -> None:
        """L1: every room whose deadline (plus grace) has passed has ended everywhere it was seen; and R4."""
        now = self.world.now
        if self._owed:
            self._check_retries(now)
        while self._deadlines:
            check_at, deadline, room = self._deadlines[0]
            if check_at + DEADLINE_GRACE_S > now:
                return
            heapq.heappop(self._deadlines)
            open_where = self.open_ranks(room)
            if open_where and all(self._excused(where, room) for where in open_where):
                heapq.heappush(self._deadlines, (now, deadline, room))
            elif open_where:
                self.fail("L1", f"room {room} is still open on {open_where} past its deadline {deadline * 1000:.1f}ms")
                return

    def open_ranks(self, room: int) -> list[str]:
        """Ranks (or engines) on which `room` has not ended yet."""
        world = self.world
        state = world.rooms[room]
        where: list[str] = []
        if state.engine_failure is None and not state.decode_lost:
            if not state.decode_admitted:
                where.append(f"D{state.plan.decode} engine queue")
            else:
                where += [f"D{state.plan.decode}.{r}" for r in state.decode_pages if r not in state.decode_outcome]
        instance = world.prefill[state.plan.prefill]
        if state.prefill_session == instance.session and not state.prefill_lost:
            where += [f"P{instance.index}.{r}" for r in range(instance.tp) if r not in state.prefill_outcome]
        return where

    def _excused(self, where: str, room: int) -> bool:
        """A rank may end a room past its deadline while its process is stalled (it handles nothing), or, on
        prefill, while the room drains a write (R6: RoomFailed only once no write reads its pages; a write lives
        at most max_write_s). Both are bounded, so the room is checked again a grace period later."""
        node = self.world.nodes.get(where)
        if node is None or node.endpoint is None:
            return False
        if self._stalled(node):
            return True
        endpoint = node.endpoint
        return isinstance(endpoint, PrefillEndpoint) and endpoint.room_state(room) == PrefillRoomState.DRAINING

    def _stalled(self, node: Node) -> bool:
        """The node's process is paused, or has just resumed (its timers run in the next step)."""
        if node.paused_until is not None:
            return True
        return node.resumed_at is not None and self.world.now < node.resumed_at + DEADLINE_GRACE_S

    def all_rooms_done(self) -> bool:
        return not self._deadlines or all(not self.open_ranks(r) for r in self.world.rooms)

    # ---- at the end ---------------------------------------------------------------------------------------------

    def at_end(self) -> None:
        """L1 for every room, then Q1."""
        for room in sorted(self.world.rooms):
            where = self.open_ranks(room)
            if where:
                self.fail("L1", f"room {room} never ended on {where}")
                return
        problems = self.quiescence_problems()
        if problems:
            self.fail("Q1", "; ".join(problems[:6]))

    def quiescence_problems(self) -> list[str]:
        world = self.world
        problems: list[str] = []
        if world.writes:
            problems.append(f"{len(world.writes)} writes still in flight")
        if any(world.scatters.values()) or world.fences:
            problems.append("scatters or fences still in flight")
        for node in world.nodes.values():
            endpoint = node.endpoint
            if endpoint is None:
                continue
            if node.ring is not None and node.ring.num_live:
                live = ", ".join(f"e{a.epoch}[{a.offset},{a.end})" for a in node.ring.live()[:4])
                problems.append(f"{node.peer_id}: ring still holds {node.ring.num_live} allocations ({live})")
            if node.pool is not None and node.pool.in_use:
                owners = sorted(set(node.pool.owners().values()))[:4]
                problems.append(f"{node.pool.name}: {node.pool.in_use} pages not returned (rooms {owners})")
            if endpoint.open_rooms():
                problems.append(f"{node.peer_id}: rooms still open {sorted(endpoint.open_rooms())[:4]}")
            if endpoint.rooms_with_timers():
                problems.append(
                    f"{node.peer_id}: timers still pending for rooms {sorted(endpoint.rooms_with_timers())[:4]}"
                )
            if isinstance(endpoint, PrefillEndpoint) and endpoint.parked_count():
                problems.append(f"{node.peer_id}: {endpoint.parked_count()} chunks still parked")
            if not endpoint.is_quiescent():
                problems.append(f"{node.peer_id}: endpoint not quiescent (retries or work pending)")
        return problems
