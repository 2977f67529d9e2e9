"""The simulated engines: decode and prefill instances that admit, compute, abort, crash and restart.

Owns the `Engines` part of `World`. Decode admits rooms FIFO when every rank's KV pool has pages for the whole
prompt, then calls `ExpectRoom` on each rank; when every rank succeeded it generates for a while and frees its
pages, and when one rank fails it aborts the room on the others (a room is one request). Prefill attaches rooms
when they arrive but computes a room only once decode has admitted it (the bootstrap), in chunked forward passes
in arrival order, limited by its own KV pool (R11), each pass announced by `ComputeScheduled` and finished by
`KVReady`. Rooms are aborted from either side; prefill instances crash and restart with a new session id (also
right after posting a slow write, so decode quarantines that room when it meets the new incarnation); decode
instances crash while a write to them is in flight and restart with new sessions, and every room they held ends
with them. Each node keeps one clock (`NodeClock`, drifting within `Timing.clock_drift`) across restarts, and
every time an engine hands an endpoint (a deadline) is read on that node's clock.

Every random choice comes from the world's one generator, drawn in event order. Called by world.py.
"""

from __future__ import annotations

from kvstage.layout import heads_of_rank, pages_for
from kvstage.protocol import (
    AbortRoom,
    AttachRoom,
    ComputeScheduled,
    DecodeConfig,
    ExpectRoom,
    FreePages,
    KVReady,
    PrefillConfig,
)
from kvstage.sim.clock import EventKind, NodeClock
from kvstage.sim.core import WorldCore
from kvstage.sim.memory import KVMemory, PagePool, StagingMemory, TrackedRing, expected_aux, expected_kv
from kvstage.sim.records import (
    BATCH,
    FORWARD_PER_TOKEN_S,
    FORWARD_S,
    GENERATE_S,
    DecodeInstance,
    Node,
    PrefillInstance,
    RoomState,
)


class Engines(WorldCore):
    """The decode and prefill engine models of one seeded run (a part of World)."""

    # ---- construction ------------------------------------------------------------------------------------------------

    def _next_session(self) -> int:
        self._sessions += 1
        return self._sessions

    def _clock(self, peer_id: str, side: str) -> NodeClock:
        """The clock of `peer_id`'s host, drawn once (a restarted process reads the same clock). In a seed with edge
        restarts (FaultProfile.edge_clocks), decode hosts' clocks run fast and prefill hosts' slow, at the bound."""
        clock = self.clocks.get(peer_id)
        if clock is None:
            clock = NodeClock()
            if self.profile.drifting_clocks:
                drift = self.config.timing.clock_drift
                offset, rate = self.rng.uniform(1.0, 100.0), 1.0 + self.rng.uniform(-drift, drift)
                if self.edges and self.profile.edge_clocks:  # the worst case for decode's quarantine
                    rate = 1.0 + drift if side == "decode" else 1.0 - drift
                clock = NodeClock(offset, rate)
            self.clocks[peer_id] = clock
        return clock

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
                timing=self.config.timing,
            )
            node = Node(peer_id, "decode", instance.index, rank, instance.tp, clock=self._clock(peer_id, "decode"))
            node.session = self._next_session()
            node.ring = ring
            node.endpoint = self.config.decode_endpoint(config, node.session, ring=ring, codec=self.codec)
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
                peer_id=peer_id, layout=self.layout, tp_size=instance.tp, rank=rank, timing=self.config.timing
            )
            node = Node(peer_id, "prefill", instance.index, rank, instance.tp, clock=self._clock(peer_id, "prefill"))
            node.session = instance.session
            node.endpoint = self.config.prefill_endpoint(config, node.session, codec=self.codec)
            node.pool = instance.pool
            if self.payloads:
                node.kv = self._kv_memory(self.scenario.prefill_pages, heads)
            self.nodes[peer_id] = node
            self._reschedule_timer(node)

    # ---- arrival and admission ---------------------------------------------------------------------------------------

    def _on_arrive(self, room: int) -> None:
        state = self.rooms[room]
        self.decode[state.plan.decode].waiting.append(room)
        self.queue.push(state.plan.deadline, EventKind.EXPIRE, room)
        self._admit_decode(self.decode[state.plan.decode])
        self._attach_prefill(room)

    def _admit_decode(self, instance: DecodeInstance) -> None:
        """Admit waiting rooms FIFO while every rank's pool has pages for the next one."""
        while instance.waiting and instance.up:
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
            deadline = node.clock.read(plan.deadline)
            event = ExpectRoom(
                room, peers, plan.num_tokens, plan.prefix_tokens, state.decode_pages[node.rank], deadline
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
            self.feed(node, AttachRoom(room, state.plan.num_tokens, decode_tp, node.clock.read(state.plan.deadline)))
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
        self.queue.push(at, EventKind.FORWARD, (instance, instance.session, tuple(work)))

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
            aux = b""
            if end >= state.plan.num_tokens:
                instance.active.remove(room)
                aux = expected_aux(state.plan.key)
            for node in self._prefill_nodes(instance.index):
                self.feed(node, KVReady(room, end, state.prefill_pages, aux))
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

    # ---- outcomes ----------------------------------------------------------------------------------------------------

    def _room_succeeded(self, node: Node, room: int, aux: bytes) -> None:
        state = self.rooms.get(room)
        if state is None:
            return
        if node.side == "decode":
            self.checker.check_room_kv(node, state, aux)
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
            self.queue.push(self.queue.now + GENERATE_S, EventKind.GENERATED, self._room_id(state.plan))
        else:
            self._release_engine_pages(state)

    def _on_generated(self, room: int) -> None:
        state = self.rooms[room]
        if not state.pages_freed:  # (a decode crash took the pool with it)
            self._release_engine_pages(state)

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
            if state.decode_lost:
                return
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

    # ---- crashes -----------------------------------------------------------------------------------------------------

    def _on_crash(self, payload: tuple[int, float]) -> None:
        index, down = payload
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
        self.queue.push(self.queue.now + down, EventKind.RESTART, instance.index)

    def _on_restart(self, index: int) -> None:
        instance = self.prefill[index]
        self._start_prefill(instance)
        self.trace.record(self.queue.now, f"P{instance.index}", "RESTART", f"session {instance.session}")
        deferred, instance.deferred = instance.deferred, []
        for room in deferred:
            if self.rooms[room].plan.deadline > self.queue.now:  # an expired request is dropped, never attached
                self._attach_prefill(room)

    def _on_quarantine_restart(self, index: int) -> None:
        self.prefill[index].restart_armed = True

    def _restart_writer(self, instance: PrefillInstance, *, at_once: bool = False) -> None:
        """FaultProfile.quarantine_restarts and edge_restarts: the instance crashes now, right after posting a slow
        write, and comes back 10-50 ms later, so decode meets its new incarnation while the old one's write is in
        flight. `at_once` (an edge restart): it crashes before it handles or sends anything more."""
        instance.restart_armed = False
        if at_once:
            self._on_crash((instance.index, self._edge_downtime()))
        else:
            self.queue.push(self.queue.now, EventKind.CRASH, (instance.index, self.rng.uniform(0.01, 0.05)))

    def _edge_downtime(self) -> float:
        """An edge restart's writer is down 10-50 ms (decode meets its new incarnation: quarantine) or, in half of
        them, 1-1.5 x dead_after_s (decode declares it dead first and frees its space at once)."""
        if self.edge_rng.random() < 0.5:
            return self.edge_rng.uniform(0.01, 0.05)
        return self.edge_rng.uniform(1.0, 1.5) * self.config.timing.dead_after_s

    def _on_decode_crash(self, index: int) -> None:
        self.decode[index].crash_armed = True

    def _crash_decode(self, instance: DecodeInstance) -> None:
        """The decode instance's processes die with their KV pools and rings; rooms they held end with them."""
        instance.crash_armed = False
        if not instance.up:
            return
        instance.up = False
        self.trace.record(self.queue.now, f"D{instance.index}", "CRASH", "decode instance")
        for node in self._decode_nodes(instance.index):
            node.endpoint = None
            if node.timer is not None:
                self.queue.cancel(node.timer)
                node.timer = None
            for key in [key for key in self.scatters if key[0] == node.peer_id]:
                del self.scatters[key]
            for key in [key for key in self.fences if key[0] == node.peer_id]:
                del self.fences[key]
        for state in self.rooms.values():
            if state.plan.decode != instance.index or not state.decode_admitted or state.pages_freed:
                continue
            state.pages_freed = True  # the pool went with the process
            if not state.decode_done:
                state.decode_lost = True
                state.first_failure = state.first_failure or RoomState.DECODE_CRASHED
        down = self.rng.uniform(0.05, 1.5 * self.config.timing.dead_after_s)
        self.queue.push(self.queue.now + down, EventKind.DECODE_RESTART, instance.index)

    def _on_decode_restart(self, index: int) -> None:
        instance = self.decode[index]
        instance.up = True
        self._build_decode(instance)
        self.trace.record(self.queue.now, f"D{index}", "RESTART", "decode instance, new sessions")
        self._admit_decode(instance)
