"""The `mooncake` data backend: Mooncake Transfer Engine (`mooncake-transfer-engine-non-cuda`) on CPU memory.

Owns: one `mooncake.engine.TransferEngine`, the regions registered with it, the imported peers' descriptors
(session, address, owner pid and process space), the worker threads that post writes and wait for them, the batches
still moving after their write stopped waiting (`_stranded`), and the guard on its TCP connections.

How it works. The engine starts with the P2P handshake (no metadata service: a peer is named by its session
"host:rpc_port") over TCP by default; `TransportConfig(mooncake_protocol="rdma", mooncake_device="mlx5_0")`
selects RDMA. A descriptor carries the owner's session and the region's base address (a write targets
`base + offset` in the peer's registered memory), and the owner's pid and process space (this kernel's boot id
and the owner's pid namespace), from which a writer in the same space tells a dead owner. Writes run on `_WORKERS`
threads, and `poll` collects what they finished. A worker posts each slice as a one-task batch
(`transfer_submit_write`), in pieces of at most `_MAX_TASKS_PER_CALL`, and looks at them every `_POLL_S`
(`transfer_check_status`, the binding's only status check that does not block, and only for a batch's first task)
until each has landed or failed, or `TransportConfig.write_timeout_s` has passed. Mooncake's blocking calls are not
used: they poll in a loop that never pauses (`_POLL_S` says what that did). A write of n slices is n engine tasks
(n operations).

Logging. The engine logs through glog to standard error, a dozen INFO lines per engine (topology discovery,
listening port, every segment removed at close), which would bury the caller's own output. Unless `MC_LOG_LEVEL`
is set, kvstage sets it to WARNING before the engine module loads (it is read then): warnings and errors still
show. `GLOG_minloglevel` has no effect on this wheel.

Bounded writes. A piece is posted only if the write's `not_after` has not passed when its worker is about to post it
(`LEASE_EXPIRED` otherwise, with `peer_gone` if the peer is gone, as for a failed write); with
`TransportConfig.max_write_s`, the write goes in pieces of at most `PIECE_BYTES` and none is posted once half of
`max_write_s` has passed since the first. Once a slice is posted, Mooncake offers no way to stop it, so over TCP
kvstage stops it at the socket (`tcp_guard.ConnectionGuard`), on this process's connections to the data port that
a descriptor names (`data_port`, found at start as the port the engine listens on besides its handshake port):
- a watcher thread sets TCP_USER_TIMEOUT, half of `max_write_s`, on each such connection (connecting ones too)
  within `_BOUND_EVERY_S` of a write: the kernel aborts a connection whose data stays unacknowledged that long,
  instead of sending it again for up to half an hour, so bytes handed to the kernel do not land after a heal;
- a write stops waiting `_GIVE_UP_SHARE` of `max_write_s` after it started (or after `write_timeout_s`). Its slices
  still moving may sit in Mooncake's own per-peer queue, behind its 4 connections (or waiting for a new one once the
  kernel aborted them), which would send them whenever a connection succeeds, after a heal too. So they are kept
  (`_Stranded`, at most `_MAX_STRANDED`, freed once they end), and until none is left the watcher cuts every
  connection to that peer's data port every `_SEVER_EVERY_S`, connecting ones included: Mooncake then fails the
  slices on the cut connections and, once no connection can be made, its whole queue for the peer. New writes to
  that peer meanwhile fail at once, naming why.
A peer whose descriptor names no data port is bounded by its pieces only (logged at import).

Invariants: a rejected, unreachable or timed-out write becomes a failed completion naming the peer session (with
`peer_gone` when the owner's pid no longer runs in this process space, or else its handshake port refuses
connections: Mooncake itself gives every failure code -1); the engine enforces on the reader side that a write
lands inside registered memory, and `DataTransport` checks region bounds before submitting. Called through
`kvstage.transport.data.create_transport`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvstage.errors import TransportError, TransportUnavailable
from kvstage.protocol.reasons import LEASE_EXPIRED
from kvstage.transport.data.base import (
    Completion,
    DataTransport,
    LocalRegion,
    PostBy,
    RegionDescriptor,
    RemoteRegion,
    Slice,
    TransportConfig,
    WriteBound,
)
from kvstage.transport.data.local import pid_alive
from kvstage.transport.data.tcp_guard import ConnectionGuard, Endpoint, endpoint, listening_ports
from kvstage.transport.data.workers import JobRunner

log = logging.getLogger(__name__)

_WORKERS = 2
_MAX_TASKS_PER_CALL = 512
"""Most slices a worker posts before it waits for them: Mooncake's TCP transport rejects (fails) work beyond a
per-peer queue of 1024 transfers, so a long `write_batch` goes out as consecutive pieces of at most this many."""
_SESSION_RE = re.compile(r"[A-Za-z0-9.\-:\[\]]{1,200}:\d{1,5}")
#: How long the cause probe of a failed write waits for the peer's handshake port (see `_peer_gone`).
_PROBE_TIMEOUT_S = 1.0
_MAX_PID = 1 << 22  # Linux's pid_max ceiling
_POLL_S = 0.0001
"""How often a worker looks at the slices it posted. Mooncake's own blocking calls (`batch_transfer_sync_write`,
`get_batch_transfer_status`) look in a loop that never pauses: the two writer threads of each prefill rank burned
about 90 s of CPU each in one run of tests/e2e/test_hosts.py, starving the rest of the 2-core host (decode's engine
too, whose writes then stalled until Mooncake's 30 s progress timeout)."""
#: `transfer_check_status` answers: landed (and freed), failed (and freed); 0 is moving, -2 a slice timed out.
_LANDED = 1
_FAILED = -1
_ENDED = (_LANDED, _FAILED)
_MAX_STRANDED = 4096
#: While writes are in flight, new connections to peers' data ports get their TCP_USER_TIMEOUT within this.
_BOUND_EVERY_S = 0.2
#: While slices of writes that gave up are still moving, their peers' connections are cut this often.
_SEVER_EVERY_S = 0.02
_GIVE_UP_SHARE = 0.75
"""A bounded write stops waiting this share of `max_write_s` after it started (the last piece starts before half):
its slices still moving are then cut off (`_Stranded`), with the rest of `max_write_s` for that to take."""
_MAX_SPACE = 100


class _MooncakeRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Payload of a mooncake descriptor: the owner's engine session, the region's base address, and the owner's
    pid with the identity of the kernel and pid namespace it runs in (`_process_space`), so that a writer in the
    same one can tell a dead owner by its pid rather than by its handshake port alone (`_peer_gone`)."""

    session: str
    address: int
    pid: Annotated[int, msgspec.Meta(ge=1, le=_MAX_PID)]
    space: Annotated[str, msgspec.Meta(max_length=_MAX_SPACE)]
    #: The TCP port the owner's engine receives writes on (0: not known, or RDMA).
    data_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0


@dataclass(frozen=True, slots=True)
class _Write:
    """One write for a worker: `slices` from local memory at `src` into `peer`'s memory at its region's address;
    `endpoints` are the peer's data port at each of its addresses (empty: not known, or not TCP)."""

    transfer_id: int
    peer: _MooncakeRef
    endpoints: frozenset[Endpoint]
    src: int
    slices: tuple[Slice, ...]
    bound: WriteBound

    @property
    def ops(self) -> int:
        return len(self.slices)


def load_engine_class() -> Any:
    """Mooncake's `TransferEngine` class, or `TransportUnavailable` naming the extra (and libibverbs1)."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # glog INFO lines on stderr; see "Logging" above
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]
    except ImportError as err:
        raise TransportUnavailable(
            "the mooncake backend needs Mooncake's transfer engine: pip install 'kvstage[mooncake]' "
            f"(it also needs the system library libibverbs1, e.g. apt-get install libibverbs1); import failed: {err}"
        ) from err
    return TransferEngine


class MooncakeTransport(DataTransport):
    """Mooncake Transfer Engine backend; TCP with P2P handshake by default, RDMA by config."""

    backend = "mooncake"

    def __init__(self, config: TransportConfig) -> None:
        engine_class = load_engine_class()
        super().__init__(config)
        self._engine = engine_class()
        tcp = config.mooncake_protocol == "tcp"
        before = listening_ports() if tcp else set()
        rc = self._engine.initialize(
            config.host, config.mooncake_metadata_server, config.mooncake_protocol, config.mooncake_device
        )
        if rc != 0:
            raise TransportError(
                f"Mooncake transfer engine failed to start on {config.host} with protocol "
                f"{config.mooncake_protocol!r} (code {rc}); for rdma check mooncake_device"
            )
        rpc_port = self._engine.get_rpc_port()
        self.session = f"{config.host}:{rpc_port}"
        self._data_port = _data_port(before, rpc_port) if tcp else 0
        self._peers: dict[int, _MooncakeRef] = {}
        self._endpoints: dict[int, frozenset[Endpoint]] = {}
        self._writer: JobRunner[_Write] = JobRunner(
            f"kvstage-mooncake-{config.name}", self._run, _WORKERS, notify=self._completed
        )
        self._stranded = _Stranded()
        self._running = 0  # writes running now
        self._started = 0  # writes started so far
        self._running_lock = threading.Lock()
        self._stopping = threading.Event()
        self._nudge = threading.Event()
        self._guard: ConnectionGuard | None = None
        self._watcher: threading.Thread | None = None
        if tcp and config.max_write_s is not None:
            self._guard = ConnectionGuard(config.max_write_s / 2)
            self._watcher = threading.Thread(
                target=self._bound_connections, name=f"kvstage-mooncake-bound-{config.name}", daemon=True
            )
            self._watcher.start()

    def _register(self, region: LocalRegion) -> None:
        rc = self._engine.register_memory(region.address, region.nbytes)
        if rc != 0:
            raise TransportError(f"Mooncake could not register {region.nbytes} bytes (code {rc})")

    def _unregister(self, region: LocalRegion) -> None:
        rc = self._engine.unregister_memory(region.address)
        if rc != 0:
            log.warning("Mooncake could not unregister region %d (code %d)", region.region_id, rc)

    def _export_payload(self, region: LocalRegion) -> bytes:
        ref = _MooncakeRef(self.session, region.address, os.getpid(), _process_space(), self._data_port)
        return msgspec.msgpack.encode(ref)

    def _import(self, descriptor: RegionDescriptor, remote: RemoteRegion) -> None:
        try:
            ref = msgspec.msgpack.decode(descriptor.payload, type=_MooncakeRef)
        except msgspec.DecodeError as err:
            raise TransportError(f"malformed mooncake descriptor from {descriptor.owner!r}: {err}") from err
        if _SESSION_RE.fullmatch(ref.session) is None or ref.address <= 0:
            raise TransportError(f"mooncake descriptor from {descriptor.owner!r} has session {ref.session!r}")
        endpoints = _data_endpoints(ref) if self._guard is not None else frozenset()
        if endpoints:
            assert self._guard is not None
            self._guard.watch(endpoints)
        self._peers[remote.key] = ref
        self._endpoints[remote.key] = endpoints

    def _bound_connections(self) -> None:
        """Watcher thread: while writes run, and once after writes that ran between two looks, give new
        connections to watched data ports their TCP_USER_TIMEOUT; while slices of writes that gave up are still
        moving, cut every connection to their peers' data ports, so that Mooncake fails them rather than sending
        them on a new connection (kvstage.transport.data.tcp_guard). Together: no posted write lands later than
        `max_write_s` after it started."""
        assert self._guard is not None
        looked_at = 0
        while True:
            self._nudge.wait(_SEVER_EVERY_S if self._stranded else _BOUND_EVERY_S)
            self._nudge.clear()
            if self._stopping.is_set():
                return
            try:
                self._sever_stranded(self._guard)
                if self._running or self._started != looked_at:
                    looked_at = self._started
                    self._guard.bound()
            except OSError as err:
                log.error("cannot read this process's sockets (%s): mooncake writes are no longer bounded", err)
                return

    def _sever_stranded(self, guard: ConnectionGuard) -> None:
        held = self._stranded.sweep(self._engine.transfer_check_status)
        severed = guard.sever(held)
        if severed:
            log.warning("mooncake: cut %d connection(s) to %s, where %d slices of writes that gave up are still "
                        "moving", severed, _names(held), len(self._stranded))  # fmt: skip

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        with self._running_lock:
            self._running += 1
            self._started += 1
        try:
            yield
        finally:
            with self._running_lock:
                self._running -= 1

    def _forget(self, remote: RemoteRegion) -> None:
        self._peers.pop(remote.key, None)
        self._endpoints.pop(remote.key, None)

    def _submit(
        self, transfer_id: int, src: LocalRegion, dst: RemoteRegion, slices: Sequence[Slice], bound: WriteBound
    ) -> str:
        write = _Write(transfer_id, self._peers[dst.key], self._endpoints[dst.key], src.address, tuple(slices), bound)
        self._writer.submit(write)
        return ""

    def _run(self, write: _Write) -> Completion:
        """On a worker thread: post the write piece by piece, as its bound allows, and wait for each piece."""
        with self._writing():
            return self._move(write)

    def _move(self, write: _Write) -> Completion:
        gone = False
        max_write_s = write.bound.max_write_s
        give_up = time.monotonic() + max_write_s * _GIVE_UP_SHARE if max_write_s is not None else float("inf")

        def call(piece: tuple[Slice, ...], _: PostBy) -> str:
            nonlocal gone
            failure = self._post(write, piece, give_up)
            if not failure:
                return ""
            cause = _peer_gone(write.peer)
            gone = bool(cause)
            cause = cause or "peer unreachable or rejected it"
            return f"mooncake write to {write.peer.session} failed ({failure}): {cause}"

        if self._watcher is None:  # else the watcher frees them
            self._stranded.sweep(self._engine.transfer_check_status)
        moving = self._stranded.moving(write.endpoints)
        if moving:
            reason = (
                f"mooncake write to {write.peer.session} refused: {moving} slices of writes to it that gave up are "
                "still moving, and its connections are cut until they end"
            )
        else:
            reason = write.bound.move(write.slices, call, _MAX_TASKS_PER_CALL)
        if reason == LEASE_EXPIRED:  # nothing was posted; if the peer is gone too, that is what its room should say
            gone = bool(_peer_gone(write.peer))
        if reason:
            log.warning("transfer %d: %s", write.transfer_id, reason)
        return Completion(write.transfer_id, not reason, reason, write.ops, peer_gone=gone)

    def _post(self, write: _Write, piece: tuple[Slice, ...], give_up: float) -> str:
        """Post each slice of `piece` as a one-task batch and wait for all of them, until `write_timeout_s` or the
        write's `give_up` (`time.monotonic()`): "" once every one has landed, else what went wrong (the slices
        posted before a refusal are waited for too)."""
        batches: list[int] = []
        refused = 0
        for s_off, d_off, length in piece:
            batch = self._engine.transfer_submit_write(
                write.peer.session, write.src + s_off, write.peer.address + d_off, length
            )
            if not batch:  # Mooncake could not open the peer's segment, or refused the task
                refused = len(piece) - len(batches)
                break
            batches.append(batch)
        deadline = min(time.monotonic() + self.config.write_timeout_s, give_up)
        failure = self._wait(write, batches, deadline)
        if refused:
            return f"{refused} of {len(piece)} slices refused" + (f", {failure}" if failure else "")
        return failure

    def _wait(self, write: _Write, batches: list[int], deadline: float) -> str:
        """Poll `batches` (one task each) every `_POLL_S` until each has ended or `deadline` has passed; "" when all
        landed, else how many failed or are still moving (those are kept in `_stranded`)."""
        started = time.monotonic()
        failed = 0
        while batches:
            pending = []
            for batch in batches:
                status = self._engine.transfer_check_status(batch)  # frees the batch once it has ended
                if status == _FAILED:
                    failed += 1
                elif status != _LANDED:  # moving, or timed out (Mooncake keeps that batch): wait for its end
                    pending.append(batch)
            batches = pending
            if batches and time.monotonic() > deadline:
                self._stranded.add(write.endpoints, batches)
                self._nudge.set()
                return f"{len(batches)} slices still moving after {time.monotonic() - started:.1f} s"
            if batches:
                time.sleep(_POLL_S)
        return f"{failed} slices failed" if failed else ""

    def _progress(self) -> list[Completion]:
        return self._writer.drain()

    def _close(self) -> None:
        self._writer.stop()
        self._stopping.set()
        self._nudge.set()
        if self._watcher is not None:
            self._watcher.join()
        self._stranded.sweep(self._engine.transfer_check_status)
        if self._stranded:
            log.warning("mooncake: %d batches had not ended at close", len(self._stranded))
        for region in list(self._regions.values()):
            self._unregister(region)
        self._peers.clear()
        self._endpoints.clear()
        self._engine = None


class _Stranded:
    """Batches still moving after their write stopped waiting, each with its peer's data endpoints. Mooncake frees
    a batch only when asked after its end (freeing a running one is unsafe), so they are kept until then; while a
    peer has any, its connections are cut (`MooncakeTransport._bound_connections`) and new writes to it refused. At
    most `_MAX_STRANDED` are kept; beyond that the oldest are left to Mooncake, which keeps their memory, and their
    peer is no longer cut off for them (logged)."""

    def __init__(self) -> None:
        self._batches: dict[int, frozenset[Endpoint]] = {}  # batch -> its peer's endpoints, oldest first
        self._since = 0.0  # when the oldest batch kept now was added
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, endpoints: frozenset[Endpoint], batches: Sequence[int]) -> None:
        with self._lock:
            if not self._batches:
                self._since = time.monotonic()
            self._batches.update(dict.fromkeys(batches, endpoints))
            excess = len(self._batches) - _MAX_STRANDED
            for batch in list(self._batches)[: max(excess, 0)]:
                del self._batches[batch]
        if excess > 0:
            log.error("mooncake: %d batches that never ended are no longer looked at (their memory leaks)", excess)

    def moving(self, endpoints: frozenset[Endpoint]) -> int:
        """How many kept batches write to a peer at `endpoints`."""
        with self._lock:
            return sum(1 for held in self._batches.values() if held & endpoints) if endpoints else 0

    def sweep(self, status: Callable[[int], int]) -> set[Endpoint]:
        """Forget (and so free) the batches that have ended, by `status` (`transfer_check_status`); the endpoints
        of the peers of those still moving."""
        with self._lock:
            if not self._batches:
                return set()
            self._batches = {batch: held for batch, held in self._batches.items() if status(batch) not in _ENDED}
            if not self._batches:
                log.info("mooncake: every slice of writes that gave up has ended, %.2f s after the first of them gave "
                         "up", time.monotonic() - self._since)  # fmt: skip
            return set().union(*self._batches.values())


def _data_endpoints(ref: _MooncakeRef) -> frozenset[Endpoint]:
    """The data port of `ref`'s engine at each address its host name resolves to (empty, with a warning, where
    that is not known: its writes are then bounded by the kernel's retransmissions only)."""
    host = ref.session.rpartition(":")[0].strip("[]")
    if not ref.data_port:
        log.warning("mooncake peer %s did not say its data port: writes to it are not bounded", ref.session)
        return frozenset()
    try:
        infos = socket.getaddrinfo(host, ref.data_port, type=socket.SOCK_STREAM)
    except OSError as err:
        log.warning("cannot resolve mooncake peer %s (%s): writes to it are not bounded", ref.session, err)
        return frozenset()
    return frozenset(endpoint(str(info[4][0]), ref.data_port) for info in infos)


def _names(endpoints: set[Endpoint]) -> str:
    return ", ".join(f"{address}:{port}" for address, port in sorted(endpoints))


def _data_port(before: set[int], rpc_port: int) -> int:
    """The port the engine just started receives TCP writes on: the one it listens on besides its handshake port
    (`rpc_port`) that this process did not listen on `before`; 0 (with a warning) if that is not one port."""
    new = listening_ports() - before - {rpc_port}
    if len(new) == 1:
        return new.pop()
    log.warning(
        "cannot tell the mooncake engine's data port (new listening ports %s): writes to this engine are bounded "
        "by the kernel's retransmissions only", sorted(new),
    )  # fmt: skip
    return 0


def _peer_gone(peer: _MooncakeRef) -> str:
    """Why the peer engine `peer` is gone, or "" when it may still be there.

    Mooncake reports every failed write with the same code (-1), so the cause is probed here, on the worker
    thread. A peer in this process space (same kernel and pid namespace, `_process_space`) whose pid no longer runs
    is gone, whatever now listens on its old handshake port: Mooncake picks those ports at random, so another
    engine may have taken it. Otherwise (a live pid, or a peer elsewhere) a refused connection on the handshake
    port means no engine listens there any more (it closed, or its process exited); a timeout or an unreachable host
    says nothing about the peer, and counts as not gone."""
    if peer.space and peer.space == _process_space() and not pid_alive(peer.pid):
        return f"peer dead: owner process {peer.pid} has exited"
    host, _, port = peer.session.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S):
            return ""
    except ConnectionRefusedError:
        return "nothing listens on its handshake port any more"
    except OSError:
        return ""


@cache
def _process_space() -> str:
    """This kernel's boot id and this process's pid namespace ("<boot id>/pid:[<inode>]"), or "" where procfs
    does not tell: two processes with the same non-empty value see each other's pids. (A hostname would not do:
    containers on one host may share it across pid namespaces, or differ while sharing one.)"""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError as err:
        log.debug("cannot identify this process space (%s); dead mooncake peers are told by their port only", err)
        return ""
    space = f"{boot_id}/{namespace}"
    return space if len(space) <= _MAX_SPACE else ""
