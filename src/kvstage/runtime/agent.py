"""The machinery every runtime agent shares: configuration, outcomes, and the reactor thread that drives it all.

Owns `BaseAgent` (its values are in config.py, what it knows of its peers in peers.py), the base of
`DecodeAgent` (decode.py) and `PrefillAgent` (prefill.py). An agent drives one protocol endpoint with real
sockets, a real data transport, gather/scatter on the engine's KV, a clock and metrics, all from ONE thread, the
reactor: it waits on its mailbox and its control socket (reactor.py), reads and answers control frames itself
(transport/control.py has no thread), queues its gathers and scatters on its own CUDA stream or copies in place on
the CPU (`DeviceWork`), posts writes, polls CUDA events and transport completions, and runs the protocol's timers.
A chunk's handoff thus crosses no Python thread on either side between the engine's call and the outcome. Two
helper threads stay off that path: the peer resolver (bootstrap lookups, `directory.py`) and, on prefill, the
importer (imports of decode memory, which NIXL can block for seconds), whose results come back through the
mailbox as `AgentTask`s; a transport whose native calls block (mooncake, nixl) runs them on threads of its own
that wake the reactor when a write completes. The engine-facing API is small and never blocks:

    decode engine:  agent.expect_room(room, prefill_peers, num_tokens, prefix_tokens, pages, timeout_s)
                    agent.abort(room);  agent.poll() -> [RoomOutcome]
    prefill engine: agent.attach_room(room, num_tokens, decode_tp, timeout_s)
                    agent.compute_scheduled(room, end_tokens);  agent.kv_ready(room, end_tokens, pages, aux=b"")
                    agent.abort(room);  agent.poll() -> [RoomOutcome]

Each engine call only appends an event to the agent's mailbox (and wakes the reactor if it sleeps). `poll` pops
finished outcomes. Memory ownership (docs/integration.md has the full story): the engine owns its KV (a `KVPool`,
or its own tensors wrapped as an `EngineKV`) and a room's pages; kvstage only reads (prefill) or writes (decode)
them between the engine call and the room's outcome.

Invariants:
- a blocking call never runs on the engine's thread, nor on the reactor: bootstrap lookups run on the resolver
  thread, imports on the importer thread; the reactor never waits for the device (it polls events);
- every action with a token gets exactly one Completion back (write, scatter, fence), and every Send either goes
  to the control channel or comes back as SendFailed, so the endpoint's failure handling always runs;
- a transport error, a gather/scatter error or an endpoint bug fails (at most) one room with a reason, logged and
  counted; the reactor never dies because of one room;
- inbound frames wait only in ZeroMQ's bounded receive queue (control.py); the reactor reads at most
  `ChannelConfig.recv_batch` of them a turn, reads only their head (`_peek`), refuses there a body this side never
  takes, and decodes one once its sender is verified (peers.py); sends parked for unresolved peers are bounded in
  peers, count, bytes and time (`outbox.py`, `AgentConfig.park`);
- a send that fails never changes a room the addressee has no part in (the endpoint checks, R3);
- per-peer state goes when the peer goes, and a stranger never changes a room: peers.py keeps both (it releases
  departed peers, and verifies every inbound frame's sender before the endpoint sees it).

Called by decode.py and prefill.py (subclasses), engines (docs/integration.md, tests/runtime/runtime_worker.py)
and `kvstage bench` through `kvstage.runtime`.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

import msgspec
import torch

from kvstage.dataplane import EngineKV, KVStore
from kvstage.dataplane.engine_blocks import EngineBlocks, describe_blocks
from kvstage.errors import ConfigError, KVStageError, ProtocolError, TransportError
from kvstage.protocol import (
    AbortRoom,
    Action,
    AttachRoom,
    Codec,
    Completion,
    ComputeScheduled,
    DecodeEndpoint,
    ExpectRoom,
    FencePeer,
    FenceScatter,
    FreePages,
    KVReady,
    PrefillEndpoint,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.codec import body_tags
from kvstage.protocol.reasons import INVALID_REQUEST
from kvstage.runtime.affinity import spread_threads
from kvstage.runtime.config import AgentConfig, AgentSnapshot, RoomOutcome, check_peer
from kvstage.runtime.directory import Resolver
from kvstage.runtime.metrics import AgentMetrics
from kvstage.runtime.peers import InboundFrame, PeerLinks
from kvstage.runtime.reactor import DeviceWork, Mailbox, wait_for_work
from kvstage.runtime.reclaim import PageClaims
from kvstage.runtime.trace import ChunkTrace
from kvstage.transport.auth import FrameAuth
from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.control import ControlChannel
from kvstage.transport.data import (
    DataTransport,
    LocalRegion,
    create_transport,
    encode_descriptor,
)
from kvstage.transport.directory import Directory, open_directory

log = logging.getLogger(__name__)

#: While device work or writes are in flight the reactor polls them: first after BUSY_POLL_MIN_S, doubling up to
#: BUSY_POLL_MAX_S with each wait that passes with nothing done (a completion starts over from the minimum). A
#: chunk's device work takes tens of microseconds, so the first polls come that soon; transports that complete on
#: threads of their own (mooncake, nixl) also wake the reactor, and the poll is then only a backstop. With nothing
#: in flight it sleeps up to IDLE_POLL_S when no post, frame or timer comes.
BUSY_POLL_MIN_S = 0.00002
BUSY_POLL_MAX_S = 0.002
IDLE_POLL_S = 0.05
#: How often the reactor releases the state of peers that left and fails sends parked for too long.
PEER_SWEEP_S = 0.5
#: The snapshot and the gauges are refreshed at most this often, and only after turns that did something (they walk
#: the endpoint's tables; an idle reactor does not wake for them).
REFRESH_S = 0.01


@dataclass(frozen=True, slots=True)
class AgentTask:
    """Work another thread of the agent hands back to the reactor, which runs `run()` in its loop (guarded like
    every step): how a blocking call made off the reactor reports its result."""

    run: Callable[[], None]


_STOP = object()
_WAKE = object()  # a write completed on a transport's own thread: the turn polls the transport


class BaseAgent(PeerLinks):
    """Shared machinery: mailbox, reactor, control channel, resolver, bootstrap record, outcomes, metrics."""

    def __init__(self, config: AgentConfig, kv: KVStore) -> None:
        """`kv`: this rank's KV, a `KVPool` or the engine's own tensors (`EngineKV`)."""
        if kv.layout != config.layout:
            raise ConfigError(f"KV layout {kv.layout} differs from the agent's layout {config.layout}")
        super().__init__(config.park)
        self.config = config
        self.pool = kv
        self.peer_id = config.peer_id
        self.metrics = AgentMetrics(self.role, self.peer_id)
        self.trace = ChunkTrace(config.trace_chunks)
        self.session = time.time_ns()
        self._codec = Codec(config.channel.max_frame_bytes)
        self._mailbox = Mailbox()
        self._outcomes: deque[RoomOutcome] = deque()
        self._work: deque[Any] = deque()
        self._draining = False
        self._poll_delay = BUSY_POLL_MIN_S
        self._next_sweep = 0.0
        self._next_refresh = 0.0  # when the snapshot and gauges may be refreshed next
        self._stale = True  # something the snapshot shows may have changed since its last refresh
        self._moved = False  # a transfer completed or a scatter landed this turn
        self._snapshot = AgentSnapshot()
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{self.role}-reactor", daemon=True)
        self._started = False
        self.transport: DataTransport
        self.pool_region: LocalRegion | None = None
        self.engine_blocks: EngineBlocks | None = None  # where an engine's KV lies in `pool_region` (direct path)
        self.device_work = DeviceWork(kv.device)  # the reactor's stream (GPU KV) for gathers and scatters
        self._claims = PageClaims()  # the engine's hold on each room's pages, against the copies that use them

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> BaseAgent:
        """Create the transport and memory, bind the control channel, register with the bootstrap, start threads.

        Blocking (network), so call it at engine start-up, not on the scheduler path. Every thread it starts may run on
        every CPU of the process, even when the calling thread is pinned to fewer (affinity.py).
        """
        with spread_threads(self.peer_id):
            return self._start()

    def _start(self) -> BaseAgent:
        self.transport = create_transport(self.config.bounded_transport)
        self.transport.on_completion(lambda: self._mailbox.put(_WAKE))
        try:
            descriptors = self._setup_memory()
            self.endpoint = self._make_endpoint()
            self._accepted_tags = body_tags(self.endpoint.accepted_bodies())
            self.channel = ControlChannel(
                self.config.control_bind,
                encode=self._codec.encode,
                decode=self._peek,
                deliver=self._deliver,
                on_reject=self.metrics.frame_rejected,
                config=self.config.channel,
                name=self.peer_id,
                auth=None if self.config.secret is None else FrameAuth(self.config.secret),
                insecure=self.config.insecure,
            ).start()
            record = self.config.record(self.role, self.channel.address, self.session, descriptors)
            self.resolver = Resolver(
                self.config.bootstrap,
                self._mailbox.put,
                refresh_s=self.config.resolve_refresh_s,
                max_peers=self.config.limits.max_peers,
                unresolved_ttl_s=self.config.park.ttl_s,
                secret=self.config.secret,
                timeout_s=self.config.bootstrap_timeout_s,
                name=f"{self.peer_id}-resolver",
            ).start(record)
        except BaseException:
            self.transport.close()
            raise
        self._started = True
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the reactor, withdraw the bootstrap record, close sockets and the transport."""
        if not self._started:
            return
        self._started = False
        self._mailbox.put(_STOP)
        self._thread.join(10)
        self.resolver.close()  # withdraws this rank's record
        if not self._thread.is_alive():  # else the reactor still owns the sockets and the eventfd; they go with it
            self.channel.close()
            self._mailbox.close()
        self.transport.close()

    def __enter__(self) -> BaseAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine-facing -----------------------------------------------------------------------------------

    def connect(self, instance: str, tp_size: int, timeout_s: float = 30.0) -> tuple[str, ...]:
        """Rendezvous with every rank of peer `instance` (blocking: call at start-up, not per request).

        Waits until all `tp_size` ranks are registered, checks each one against this agent as every record is
        checked when it arrives (`check_peer`: layout, backend and lease timing; `ConfigError`, a
        `CompatibilityError` for the layout, naming both values on a mismatch) and returns their peer ids by rank.
        """
        client = self._bootstrap_client()
        try:
            records = client.wait_for_instance(instance, self.peer_role, tp_size, timeout_s)  # type: ignore[arg-type]
        finally:
            client.close()
        for record in records:
            check_peer(self.config, self.role, self.peer_role, record)
        return tuple(record.peer_id for record in records)

    def abort(self, room: int) -> None:
        """Give up on `room`; its outcome (failed, "aborted by ...") comes back through `poll`."""
        self._mailbox.put(AbortRoom(room))

    def reclaim(self, room: int) -> torch.cuda.Event | None:
        """The engine takes `room`'s pages back now (vLLM preempted its request; sglang failed it on another TP
        rank) and the room is aborted. When this returns no copy of kvstage's uses the pages any more (prefill: its
        gathers read them; decode: its scatters write them): on the CPU a running copy has finished; on a GPU the
        returned event follows every copy queued, and the engine's stream must wait on it before it uses the
        pages (`PageClaims`). Never blocks on the network."""
        event = self._claims.reclaim(room)
        self._mailbox.put(AbortRoom(room))
        return event

    def poll(self) -> list[RoomOutcome]:
        """Rooms that ended since the last call. Never blocks."""
        out: list[RoomOutcome] = []
        while self._outcomes:
            out.append(self._outcomes.popleft())
        return out

    def snapshot(self) -> AgentSnapshot:
        return self._snapshot

    def wait_quiescent(self, timeout_s: float) -> bool:
        """Wait (on the caller's thread; not for schedulers) until nothing is open, parked or in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._snapshot.quiescent:
                return True
            time.sleep(0.01)
        return self._snapshot.quiescent

    def export_pool(self) -> dict[str, bytes]:
        """Register the KV with this agent's transport (both sides; the direct path's source or target) and, where
        the backend can export it, return its descriptors to publish for the direct path.

        A host `KVPool` is registered as "pool"; an engine's own KV in vLLM's CPU format as "engine", its one
        allocation, with "engine_blocks" saying where each (layer, block) lies in it (dataplane/engine_blocks.py).
        The data transports move host memory, so KV on a GPU, or in another engine layout, has the staged path only
        (its gather/scatter read and write it in place)."""
        pool = self.pool
        if isinstance(pool, EngineKV):
            return self._export_engine(pool)
        if pool.device.type != "cpu":
            log.info("%s: a KV pool on %s; the direct path needs host memory", self.peer_id, pool.device)
            return {}
        self.pool_region = self.transport.register(pool.flat)
        return self._exported("pool", self.pool_region)

    def _export_engine(self, kv: EngineKV) -> dict[str, bytes]:
        found = describe_blocks(kv)
        if found is None:
            log.info("%s: the engine's %s KV on %s is staged only", self.peer_id, kv.format, kv.device)
            return {}
        self.engine_blocks, address, nbytes = found
        self.pool_region = self.transport.register_address(address, nbytes)
        descriptors = self._exported("engine", self.pool_region)
        return {**descriptors, "engine_blocks": self.engine_blocks.encode()} if descriptors else {}

    def _exported(self, name: str, region: LocalRegion) -> dict[str, bytes]:
        try:
            return {name: encode_descriptor(self.transport.export(region))}
        except TransportError as exc:
            log.info("%s: no direct path on this backend: %s", self.peer_id, exc)
            return {}

    def _host_region(self, nbytes: int) -> LocalRegion:
        """Transport memory for staging (prefill) or the ring (decode), where `staging_device` says: on the KV's GPU
        when the backend moves GPU memory (cuda_ipc, nixl), else on the host, page-locked when the KV is on a GPU, so
        the copies between it and the KV run at DMA speed (see `DataTransport.allocate`)."""
        device = self.transport.staging_device(self.pool.device)
        return self.transport.allocate(nbytes, pinned=self.pool.device.type == "cuda", device=device)

    # ---- subclass hooks ----------------------------------------------------------------------------------

    @abstractmethod
    def _setup_memory(self) -> dict[str, bytes]:
        """Register this rank's memory with the transport; return the descriptors to publish at the bootstrap."""

    @abstractmethod
    def _make_endpoint(self) -> DecodeEndpoint | PrefillEndpoint:
        """Build this rank's protocol endpoint."""

    @abstractmethod
    def _execute(self, action: Any) -> None:
        """Carry out one protocol action of this side (writes, scatters, fences); on the reactor."""

    def _after_turn(self) -> None:
        """Per-turn housekeeping on the reactor (retry waiting writes, metrics)."""

    def _progressed(self) -> None:
        """A transfer completed: poll the transport at the shortest delay again."""
        self._poll_delay = BUSY_POLL_MIN_S
        self._moved = True

    def _busy(self) -> bool:
        """True while transfers are in flight: the loop then polls the transport often."""
        return False

    # ---- the reactor -------------------------------------------------------------------------------------

    def _bootstrap_client(self) -> Directory:
        return open_directory(
            self.config.bootstrap, timeout_s=self.config.bootstrap_timeout_s, secret=self.config.secret
        )

    def _peek(self, frame: bytes) -> InboundFrame:
        """Reactor, inside `channel.receive`: the frame's sender, session and body tag, its body left undecoded;
        `ProtocolError` (counted as undecodable) for a frame whose head does not read or whose body this side never
        takes."""
        head = self._codec.peek(frame)
        if head.tag not in self._accepted_tags:
            raise ProtocolError(f"a {head.tag!r} body, which a {self.role} rank never takes")
        return InboundFrame(bytes(frame), head)

    def _deliver(self, inbound: InboundFrame) -> None:
        """A frame the channel read (inside `channel.receive`, on the reactor): verified and fed, guarded."""
        self._guarded(self._on_frame, inbound)

    def _run(self) -> None:
        self.channel.adopt()
        with self.device_work.current():
            while self._turn():
                pass
        self.channel.close()

    def _turn(self) -> bool:
        """One turn of the reactor; False once asked to stop. Its events die with it: nothing inbound stays
        referenced while the thread waits for the next turn."""
        readable = wait_for_work(self._mailbox, self.channel, self._timeout())
        stopping = False
        batch = self._mailbox.take()
        for item in batch:
            if item is _STOP:
                stopping = True
            elif item is not _WAKE:
                self._guarded(self._dispatch, item)
        received = 0
        try:
            received = self.channel.receive() if readable or batch else 0  # a post may have made a reply come
        except TransportError as exc:  # closed under the loop: the agent is stopping
            log.debug("%s: control channel: %s", self.peer_id, exc)
        self._guarded(self._poll_transport)
        self._guarded(self._after_turn)
        now = time.monotonic()
        due = self.endpoint.next_timer()
        if due is not None and now >= due:
            self._guarded(self._feed_actions, self.endpoint.tick(now))
        if now >= self._next_sweep:
            self._next_sweep = now + PEER_SWEEP_S
            self._guarded(self._release_departed, now)
        active = bool(batch or received or self._moved)
        if self._busy() and not active:  # a wait went by with nothing done: back off
            self._poll_delay = min(2 * self._poll_delay, BUSY_POLL_MAX_S)
        self._moved = False
        self._stale = self._stale or active or (due is not None and now >= due)
        if self._stale and now >= self._next_refresh:
            self._next_refresh, self._stale = now + REFRESH_S, False
            self._guarded(self._refresh_snapshot)
        return not stopping

    def _timeout(self) -> float:
        """How long the next wait may sleep: until the next timer, poll of work in flight, sweep or refresh."""
        now = time.monotonic()
        wake = min(now + (self._poll_delay if self._busy() else IDLE_POLL_S), self._next_sweep)
        if self._stale:  # what the snapshot shows changed: refresh it on time, else sleep on
            wake = min(wake, self._next_refresh)
        due = self.endpoint.next_timer()
        if due is not None:
            wake = min(wake, due)
        return wake - now

    def _guarded(self, fn: Any, *args: Any) -> None:
        """Run one step; a bug in it is logged and counted, and never kills the reactor."""
        try:
            fn(*args)
        except Exception:
            log.exception("%s: agent step %s failed", self.peer_id, getattr(fn, "__name__", fn))
            self.metrics.internal_error()

    def _dispatch(self, item: Any) -> None:
        if isinstance(item, PeerRecord):
            self._on_record(item)
        elif isinstance(item, AgentTask):
            item.run()
        else:
            self._feed(item)

    def _feed(self, event: Any) -> None:
        """Hand one event to the endpoint and carry out its actions, then those of any follow-up events (in
        order, iteratively: an action that produces an event, e.g. SendFailed, queues it behind the current one)."""
        self._work.append(event)
        if self._draining:
            return
        self._draining = True
        try:
            while self._work:
                current = self._work.popleft()
                try:
                    actions = self._handle(current)
                except KVStageError as exc:
                    log.error("%s: endpoint rejected %r: %s", self.peer_id, current, exc)
                    self._reject_engine_call(current, str(exc))
                    continue
                self._feed_actions(actions)
        finally:
            self._draining = False

    def _handle(self, event: Any) -> list[Any]:
        """The endpoint's actions for `event`; a `KVStageError` rejects an engine call (subclasses may check more
        first). An abort of a room the endpoint no longer (or never) held drops the engine's claim on its pages: no
        copy of it can be left."""
        actions = self.endpoint.handle(event, time.monotonic())
        if isinstance(event, AbortRoom) and self.endpoint.room_state(event.room) is None:
            self._claims.forget(event.room)
        return actions

    def _feed_actions(self, actions: list[Action]) -> None:
        for action in actions:
            self._guarded(self._execute_common, action)

    def _reject_engine_call(self, event: Any, reason: str) -> None:
        """A refused engine call ends its room now rather than at its deadline: a refused attach or expect with
        its own outcome (the room never opened), a refused `kv_ready` or `compute_scheduled` of an open room by
        failing that room "invalid request" (the details are logged, never a metric label)."""
        room = getattr(event, "room", None)
        if isinstance(event, ExpectRoom | AttachRoom) and room is not None:
            pages = event.pages if isinstance(event, ExpectRoom) else ()
            outcome = RoomOutcome(room, False, f"{INVALID_REQUEST}: {reason}", pages)
            self._outcome(outcome, counted_as=INVALID_REQUEST)  # one metric label, whatever the details
        elif isinstance(event, KVReady | ComputeScheduled) and self.endpoint.room_state(event.room) is not None:
            self._feed(AbortRoom(event.room, INVALID_REQUEST))

    def _execute_common(self, action: Action) -> None:
        match action:
            case Send():
                self.trace.message(action.envelope.body, "out", action.peer)
                self._send(action.peer, action.envelope)
            case FencePeer():
                self._peer_fenced(action.peer)
                self.resolver.want(action.peer)
            case (
                WriteRegion()
                | WriteDirect()
                | Scatter()
                | FenceScatter()
                | FreePages()
                | RoomSucceeded()
                | RoomFailed()
            ):
                self._execute(action)
            case _:
                assert_never(action)

    def _outcome(self, outcome: RoomOutcome, counted_as: str = "") -> None:
        if not outcome.ok:
            self.metrics.room_failed(counted_as or outcome.reason)
            log.info("%s: room %d failed: %s", self.peer_id, outcome.room, outcome.reason)
        self._outcomes.append(outcome)

    def _complete(self, token: int, ok: bool, reason: str = "", peer_gone: bool = False) -> None:
        """Report the outcome of the action `token` to the endpoint; a failure is logged with its full reason (the
        room's outcome carries only the protocol's short reason, e.g. "transfer failed", or "peer dead" when the
        transport knew that the peer is gone)."""
        if not ok:
            log.warning("%s: action %d failed: %s", self.peer_id, token, reason)
        self._feed(Completion(token, ok, reason, peer_gone))

    def _poll_transport(self) -> None:
        """Writers override; readers have nothing to poll (one-sided writes)."""

    def _gauges(self) -> None:
        """Set this side's gauges (ring, parked chunks) from its state; with the snapshot, not every turn."""

    def _refresh_snapshot(self) -> None:
        self._gauges()
        stats = self.endpoint.stats.snapshot()
        for key, count in stats.items():  # a protocol bound that refused a message (too many peers, rooms, ...)
            if key.startswith("rejected."):
                self.metrics.set_protocol_rejected(key.removeprefix("rejected."), count)
        self.metrics.set_rooms("open", len(self.endpoint.open_rooms()))
        self.metrics.set_rooms("succeeded", stats.get("rooms_succeeded", 0))
        self.metrics.set_rooms("failed", stats.get("rooms_failed", 0))
        self._snapshot = self._make_snapshot(stats)

    def _make_snapshot(self, stats: dict[str, int]) -> AgentSnapshot:
        return AgentSnapshot(
            open_rooms=len(self.endpoint.open_rooms()),
            quiescent=self.endpoint.is_quiescent(),
            pending_sends=len(self._parked),
            stats=stats,
        )


def published_blocks(record: PeerRecord) -> EngineBlocks | None:
    """Where a peer's engine KV lies in its exported allocation ("engine"), if it published that and it decodes
    within its bounds (else logged, and the peer is reached through its ring)."""
    blob = record.descriptors.get("engine_blocks")
    if blob is None:
        return None
    try:
        return EngineBlocks.decode(blob)
    except msgspec.DecodeError as exc:
        log.error("%s published unusable engine blocks: %s", record.peer_id, exc)
        return None
