"""The `nixl` data backend: NVIDIA NIXL 1.5.1 with its UCX plugin, on host memory (DRAM) and GPU memory (VRAM).

Owns: one `nixl_agent` named after `TransportConfig.name`, the regions registered with it, the remote agents
loaded from descriptors (reference-counted per owner), and the worker threads that post and wait for writes.

Which NIXL. NIXL ships one wheel per CUDA major version, whose bundled UCX loads that CUDA's runtime for its CUDA
transports: `nixl-cu12` (the `kvstage[nixl]` extra; also what a CPU-only host uses) and `nixl-cu13` (CUDA 13
hosts). `load_nixl` imports the one that matches torch's CUDA (`torch.version.cuda`) first, else whichever is
installed; a user picks by installing one (docs/gpu.md).

GPU memory (`device_memory`). A region on a GPU (`allocate(device="cuda:N")`, or a registered GPU tensor) is
registered as NIXL "VRAM" with its device index, and a write's transfer descriptors carry each side's memory type
and device, so UCX picks its CUDA transports: cuda_ipc between processes of one host, GPUDirect RDMA across hosts
(where UCX's InfiniBand modules are on, `nixl_rdma`). `staging_device` is therefore the KV's GPU: the agents' ring
and staging slab live there. `write_batch(after=event)` has the write's worker wait for the event (the gather that
filled the source) before it posts, since UCX copies on streams of its own.

How it works. A descriptor carries the owner's agent metadata (taken after the region was registered, so it lists the
region), the region's base address, memory type and device; importing loads that metadata into our agent, once the agent
name at its head (read without loading it, `_metadata_agent`) is the descriptor's owner: a descriptor carrying another
agent's metadata is refused before NIXL sees it, so it loads nothing and leaves a peer already loaded under that name as
it was. A write builds local and remote transfer descriptor lists (one row per slice), creates a WRITE request and posts
it. UCX carries out a same-host write inside the posting call itself (measured: `transfer()` of 64 MiB returns after
15-30 ms, with the bytes copied), so writes are posted and waited for on worker threads (`_WORKERS`, at least one per
UCX worker), never on the caller's thread, and `poll` only collects their completions.

Parallel copies. NIXL's UCX backend drives one UCX worker by default, and its STRICT thread-sync mode holds one
lock around every call, so a process's writes copied one at a time: about 5 GB/s per process on an H200 host,
whatever the number of writes in flight. The agent is therefore built with `TransportConfig.nixl_workers` UCX
workers (4 by default) and, with more than one, in RW mode: data-path calls (post, status, release) run in
parallel on the worker threads while metadata calls (register, load a peer) stay exclusive. Measured on that
host, one process, 16 MiB writes from 4 threads: 18.3 GB/s with 4 workers in RW mode, 4.7-5.4 GB/s with 1 worker
or in STRICT mode.

Remote descriptor lists are built here from plain integers; we never unpickle NIXL's serialised descriptors,
which would run code from the wire.

UCX and InfiniBand. NIXL's wheel bundles UCX with its own libibverbs and libnl-route. Where the system copies are
also present (Debian's libibverbs1, which Mooncake needs), UCX's InfiniBand modules load both copies of
libnl-route and the process dies with SIGSEGV in libnl-route's destructor at exit. Unless
`TransportConfig.nixl_rdma` is set, or the user has set `UCX_MODULES` themselves, the first NIXL transport of a
process therefore sets `UCX_MODULES=^ib` (inherited by child processes) before UCX loads: UCX then uses its
TCP, shared-memory and CMA transports (and its CUDA ones, cuda_ipc and cuda_copy, for GPU memory), which is all one
host or a TCP network can use anyway; GPUDirect RDMA across hosts needs `nixl_rdma`.

Logging. NIXL's Python package logs at INFO to standard output (a line per agent and backend), which would mix
with the caller's output; unless `NIXL_LOG_LEVEL` is set, kvstage lowers its "nixl" logger to WARNING.

Progress thread. `nixl_agent` (1.5.1) starts its progress thread with a delay of 0 between polls, so every
agent spins a core even when idle; on a small CPU machine that starves the copies and the peers it serves
(measured: 2-4x lower loopback throughput on 2 cores). The agent is therefore built with the delay from
`TransportConfig.nixl_progress_delay_us` (100 us by default; 0 restores NIXL's own), applied by handing
`nixl_agent.__init__` a bindings module whose `nixlAgent` sets `pthrDelay` on the config it receives.

Bounded writes. A write is posted only if its `not_after` has not passed when its worker is about to post it
(`LEASE_EXPIRED` otherwise). With `TransportConfig.max_write_s`, it is posted in pieces of at most `PIECE_BYTES`, one
after the other, and no piece is posted once half of `max_write_s` has passed since the first; and the first NIXL
transport of a process sets UCX's own bounds on a posted request from the other half, unless the user set them:
`UCX_TCP_USER_TIMEOUT` (unacknowledged data closes the connection) and, unless UCX's InfiniBand modules are off
(`UCX_MODULES=^ib`, where UCX would warn that they are unused), `UCX_RC_TIMEOUT` / `UCX_RC_RETRY_COUNT` (an RC or
DC queue pair that gets no acknowledgement fails), see `_ucx_timeouts`. Releasing a NIXL request does not
stop it (UCX's `ucp_request_cancel` cancels tag receives only), so those UCX timeouts are what bounds a posted
write (docs/transports.md). The deadline is checked once more right before `transfer()`, under a `PostGate` that
NIXL's metadata calls (loading or removing a peer, registering memory) hold alone: in RW mode NIXL makes data-path
calls wait for those, and loading a peer that drops its SYNs held a post 133 s (kvstage.transport.data.gate). A post
that returns after its deadline (the copy of a same-host post counts; or this process was paused inside it) is
logged.

Disconnected peers. NIXL's UCX backend makes one endpoint per UCX worker to a peer when the peer's metadata is
loaded (`add_remote_agent`), and never makes it again: an endpoint that UCX failed (the peer's process died, or
the connection closed while the peer lives: `UCX_TCP_USER_TIMEOUT` during a link cut, a reset) fails every later
write at once with NIXL_ERR_REMOTE_DISCONNECT. Only removing the peer (`remove_remote_agent`, when the last region
imported from it is forgotten) and loading it again makes new endpoints; the prefill agent does that for a decode
peer that still answers (`reconnects_on_import`, runtime/prefill.py). Loading a peer connects to it, and
`add_remote_agent` was seen blocking 11 s under vLLM across namespaced hosts (cause inside NIXL/UCX not found): it
runs under `_meta_lock` (loads and removals of remote agents, one at a time), not under the transport's lock
(`imports_unlocked`), so writes and polls go on meanwhile; the prefill agent imports on a thread of its own.

Invariants: every NIXL error (a write outside the peer's registered memory, a disconnected peer, a backend
error) becomes a failed completion with NIXL's status in the reason (NIXL_ERR_REMOTE_DISCONNECT, which NIXL raises
within milliseconds of the peer's death, or at once on an endpoint that failed while the peer lives, also sets
`peer_gone`); a request still in progress after `TransportConfig.write_timeout_s` is reported failed as timed out
and its handle released (which does not stop it: see "Bounded writes"). Called through
`kvstage.transport.data.create_transport`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from kvstage.errors import TransportError, TransportUnavailable
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
from kvstage.transport.data.gate import PostGate
from kvstage.transport.data.workers import JobRunner

log = logging.getLogger(__name__)

#: Worker threads that post and wait for writes (at least one per UCX worker): enough for a couple of writes in
#: flight to each of a few peers.
_WORKERS = 4
#: How often a worker asks NIXL whether its write is done.
_POLL_S = 0.0001
#: UCX's RC retry count (its default), which kvstage sets next to `UCX_RC_TIMEOUT` so that their product is known.
_RC_RETRIES = 7
#: Why registering GPU memory usually fails: a NIXL build whose UCX cannot load this host's CUDA.
_VRAM_HINT = (
    " (UCX's CUDA transports need the NIXL build for this host's CUDA: nixl-cu12 for CUDA 12, nixl-cu13 for "
    "CUDA 13; docs/gpu.md)"
)


#: NIXL's packages by the CUDA major version their UCX is built for; a host without CUDA takes the CUDA 12 one.
_PACKAGES = {"13": "nixl_cu13", "12": "nixl_cu12"}
#: Most GPUs a descriptor may name (a device index outside this is refused at import).
_MAX_GPUS = 1024


_METADATA_HEADER = b"nixlSerDes|Agent"
_NAME_LENGTH_BYTES = 8


def _metadata_agent(metadata: bytes) -> str | None:
    """The agent name at the head of NIXL's serialised agent metadata, read without loading it, or None where the
    blob does not start as NIXL 1.5.1 writes it: `nixlSerDes|Agent`, the name's length (8 bytes, little-endian),
    the name, then `|`. NIXL has no call that names a blob's agent without loading it into the agent."""
    start = len(_METADATA_HEADER) + _NAME_LENGTH_BYTES
    if not metadata.startswith(_METADATA_HEADER) or len(metadata) < start:
        return None
    size = int.from_bytes(metadata[len(_METADATA_HEADER) : start], "little")
    if metadata[start + size : start + size + 1] != b"|":
        return None
    try:
        return metadata[start : start + size].decode()
    except UnicodeDecodeError:
        return None


class _NixlRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Payload of a nixl descriptor: the owner agent's metadata, the region's base address, its NIXL memory type
    ("DRAM" or "VRAM") and device index (the GPU in the owner's process; 0 for DRAM)."""

    metadata: bytes
    address: int
    memory: str
    device: int


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a region's bytes are, as NIXL names it: a memory type and a device index."""

    memory: str
    device: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Place:
        if not tensor.is_cuda:
            return cls("DRAM", 0)
        return cls("VRAM", torch.cuda.current_device() if tensor.device.index is None else tensor.device.index)


@dataclass(frozen=True, slots=True)
class _Write:
    """One write for a worker: `slices` from local memory at `src` to the memory of agent `owner` at `dst`, each
    where its `_Place` says, started once `after` (a CUDA event, or None) is done."""

    transfer_id: int
    owner: str
    src: int
    dst: int
    src_place: _Place
    dst_place: _Place
    slices: tuple[Slice, ...]
    bound: WriteBound
    after: torch.cuda.Event | None

    @property
    def ops(self) -> int:
        return len(self.slices)

    def rows(self, piece: tuple[Slice, ...]) -> tuple[np.ndarray, np.ndarray]:
        """NIXL's `[address, length, device]` rows of `piece`, on the local and on the remote side."""
        slices = np.array(piece, dtype=np.uint64).reshape(-1, 3)
        local = np.zeros((len(slices), 3), dtype=np.uint64)
        local[:, 0] = slices[:, 0] + np.uint64(self.src)
        local[:, 1] = slices[:, 2]
        local[:, 2] = self.src_place.device
        remote = np.zeros_like(local)
        remote[:, 0] = slices[:, 1] + np.uint64(self.dst)
        remote[:, 1] = slices[:, 2]
        remote[:, 2] = self.dst_place.device
        return local, remote


@dataclass(frozen=True, slots=True)
class _Nixl:
    """The pieces of the nixl package this backend uses."""

    api: Any
    agent_class: Any
    config_class: Any
    strict_sync: Any
    rw_sync: Any
    errors: tuple[type[Exception], ...]
    #: NIXL_ERR_REMOTE_DISCONNECT: the peer agent's connection is gone (its process exited or closed it)
    disconnected: type[Exception]

    def sync_mode(self, workers: int) -> Any:
        """STRICT (one lock around every call) for one UCX worker; RW (data-path calls in parallel, metadata calls
        exclusive) when there are several, so that writes posted from several threads copy at once."""
        return self.strict_sync if workers == 1 else self.rw_sync


def _package_order() -> tuple[str, ...]:
    """NIXL's packages, the one built for torch's CUDA first (CUDA 12's where torch has none)."""
    first = _PACKAGES.get((torch.version.cuda or "12").split(".")[0], _PACKAGES["12"])
    return (first, *(name for name in _PACKAGES.values() if name != first))


def load_nixl() -> _Nixl:
    """NIXL's agent classes and exception types, from the first of `_package_order` that imports, or
    `TransportUnavailable` naming the pip extra."""
    failures = []
    for package in _package_order():
        try:
            api: Any = importlib.import_module(f"{package}._api")
            bindings: Any = importlib.import_module(f"{package}._bindings")
            break
        except ImportError as err:
            failures.append(f"{package}: {err}")
    else:
        raise TransportUnavailable(
            "the nixl backend needs NIXL: pip install 'kvstage[nixl]' (nixl-cu12==1.5.1), or nixl-cu13==1.5.1 on a "
            f"CUDA 13 host; import failed: {'; '.join(failures)}"
        )
    if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs every agent's start at INFO, to stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    errors = tuple(
        value
        for name, value in vars(bindings).items()
        if name.startswith("nixl") and isinstance(value, type) and issubclass(value, Exception)
    )
    sync = api.nixl_thread_sync_t
    return _Nixl(
        api,
        api.nixl_agent,
        api.nixl_agent_config,
        sync.NIXL_THREAD_SYNC_STRICT,
        sync.NIXL_THREAD_SYNC_RW,
        errors,
        bindings.nixlRemoteDisconnectError,
    )


def _ucx_timeouts(max_write_s: float, infiniband: bool) -> dict[str, str]:
    """UCX settings that make a posted request that gets no acknowledgement fail within half of `max_write_s` (the
    other half is when pieces may be posted): TCP closes a connection whose data stays unacknowledged that long; with
    `infiniband`, an RC/DC queue pair fails after (retries + 1) transport timeouts, and InfiniBand rounds the timeout
    up to 4.096 us times a power of two (up to twice the value), so each gets (max_write_s / 2) / (2 * (retries+1))."""
    budget_s = max_write_s / 2
    settings = {"UCX_TCP_USER_TIMEOUT": f"{max(1, int(budget_s * 1000))}ms"}
    if infiniband:
        rc_timeout_us = max(1, int(budget_s / (2 * (_RC_RETRIES + 1)) * 1e6))
        settings |= {"UCX_RC_TIMEOUT": f"{rc_timeout_us}us", "UCX_RC_RETRY_COUNT": str(_RC_RETRIES)}
    return settings


def _backend_params(config: TransportConfig) -> dict[str, str]:
    """Init parameters of the NIXL backend plugin: UCX gets `nixl_workers` UCX workers."""
    return {"num_workers": str(config.nixl_workers)} if config.nixl_backend == "UCX" else {}


_AGENT_CONSTRUCTION = threading.Lock()


class _PacedBindings:
    """NIXL's bindings module, except that `nixlAgent` applies a progress-thread delay to its config first."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, agent_config)


@contextlib.contextmanager
def _paced_progress_thread(api: Any, delay_us: int) -> Iterator[None]:
    """While constructing one `nixl_agent` of NIXL's `api` module, give its progress thread a delay of `delay_us`
    between polls."""
    with _AGENT_CONSTRUCTION:
        bindings = api.nixlBind
        api.nixlBind = _PacedBindings(bindings, delay_us)
        try:
            yield
        finally:
            api.nixlBind = bindings


class NixlTransport(DataTransport):
    """NIXL backend over UCX (or `TransportConfig.nixl_backend`), regions in host (DRAM) or GPU (VRAM) memory."""

    backend = "nixl"
    #: UCX built with CUDA page-locks the host memory NIXL registers (seen on an H200 host: page-locking a NIXL
    #: region again fails with cudaErrorHostMemoryAlreadyRegistered).
    pins_for_cuda = True
    device_memory = True
    #: UCX's endpoint to a peer is made when its metadata is loaded; once failed it fails every write
    #: (NIXL_ERR_REMOTE_DISCONNECT) until the peer is removed and loaded again (see "Disconnected peers").
    reconnects_on_import = True
    #: `add_remote_agent` connects to the peer and was seen blocking 11 s: it runs under `_meta_lock` only.
    imports_unlocked = True

    def __init__(self, config: TransportConfig) -> None:
        nixl = load_nixl()
        super().__init__(config)
        if not config.nixl_rdma and "UCX_MODULES" not in os.environ:
            os.environ["UCX_MODULES"] = "^ib"
        if config.max_write_s is not None:
            infiniband = os.environ.get("UCX_MODULES") != "^ib"
            for name, value in _ucx_timeouts(config.max_write_s, infiniband).items():
                os.environ.setdefault(name, value)  # read by UCX when the agent's backend starts, below
        self._errors: tuple[type[Exception], ...] = (*nixl.errors, RuntimeError)  # RuntimeError: other C++ errors
        self._disconnected = nixl.disconnected
        try:
            with _paced_progress_thread(nixl.api, config.nixl_progress_delay_us):
                nixl_config = nixl.config_class(backends=[], sync_mode=nixl.sync_mode(config.nixl_workers))
                self._agent = nixl.agent_class(config.name, nixl_config)
            if config.nixl_backend not in self._agent.plugin_list:
                raise TransportError(
                    f"NIXL has no {config.nixl_backend!r} plugin here (available: {', '.join(self._agent.plugin_list)})"
                )
            self._agent.create_backend(config.nixl_backend, _backend_params(config))
        except nixl.errors as err:
            raise TransportError(
                f"NIXL agent {config.name!r} failed to start with {config.nixl_backend}: {err}"
            ) from err
        self._registrations: dict[int, Any] = {}  # by the region's address (registered regions never overlap)
        self._peers: dict[int, _NixlRef] = {}
        self._after: torch.cuda.Event | None = None
        self._owner_refs: dict[str, int] = {}
        # loads and removals of remote agents, one at a time, and the two tables above (taken after `_lock`)
        self._meta_lock = threading.Lock()
        self._gate = PostGate()  # posts share it; NIXL's metadata calls, which data-path calls wait for, hold it alone
        self._writer: JobRunner[_Write] = JobRunner(
            f"kvstage-nixl-{config.name}", self._run, max(_WORKERS, config.nixl_workers), notify=self._completed
        )

    def _allocate_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.current_stream(tensor.device).synchronize()  # at allocation only: peers write it through UCX
        self._register_tensor(tensor)
        return tensor

    def _register(self, region: LocalRegion) -> None:
        self._register_tensor(region.tensor)

    def _register_tensor(self, tensor: torch.Tensor) -> None:
        place = _Place.of(tensor)
        address, nbytes = int(tensor.data_ptr()), int(tensor.numel())
        try:
            with self._gate.exclusive():
                self._registrations[address] = self._agent.register_memory(
                    [(address, nbytes, place.device, "")], place.memory
                )
        except self._errors as err:
            hint = _VRAM_HINT if place.memory == "VRAM" else ""
            raise TransportError(f"NIXL could not register {nbytes} bytes of {place.memory}: {err}{hint}") from err

    def _unregister(self, region: LocalRegion) -> None:
        registration = self._registrations.pop(region.address, None)
        if registration is None:
            return
        try:
            with self._gate.exclusive():
                self._agent.deregister_memory(registration)
        except self._errors as err:
            log.warning("NIXL could not deregister region %d: %s", region.region_id, err)

    def _export_payload(self, region: LocalRegion) -> bytes:
        place = _Place.of(region.tensor)
        ref = _NixlRef(self._agent.get_agent_metadata(), region.address, place.memory, place.device)
        return msgspec.msgpack.encode(ref)

    def _import(self, descriptor: RegionDescriptor, remote: RemoteRegion) -> None:
        try:
            ref = msgspec.msgpack.decode(descriptor.payload, type=_NixlRef)
        except msgspec.DecodeError as err:
            raise TransportError(f"malformed nixl descriptor from {descriptor.owner!r}: {err}") from err
        if descriptor.owner == self.name:
            raise TransportError(f"nixl descriptor from {descriptor.owner!r} names this agent (names must be unique)")
        if ref.memory not in ("DRAM", "VRAM") or not 0 <= ref.device < _MAX_GPUS:
            raise TransportError(
                f"nixl descriptor from {descriptor.owner!r} names memory {ref.memory!r} on device {ref.device}"
            )
        named = _metadata_agent(ref.metadata)
        if named != descriptor.owner:  # checked before loading: a refused blob must not touch a loaded peer
            what = "no NIXL agent header" if named is None else f"metadata of agent {named!r}"
            raise TransportError(f"nixl descriptor from {descriptor.owner!r} carries {what}")
        with self._meta_lock:  # off the transport's lock (`imports_unlocked`): loading may block for seconds
            if self._agent is None:
                raise TransportError("the transport was closed during the import")
            known = set(self._owner_refs)
            try:
                with self._gate.exclusive():  # NIXL undoes a load it fails itself
                    loaded = self._agent.add_remote_agent(ref.metadata)
            except self._errors as err:
                raise TransportError(f"NIXL could not load the metadata of {descriptor.owner!r}: {err}") from err
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != descriptor.owner:  # NIXL read another name than its header says: undo what it loaded
                if name not in known:
                    self._remove_agent(name)
                raise TransportError(f"nixl descriptor from {descriptor.owner!r} carries metadata of agent {name!r}")
            self._peers[remote.key] = ref
            self._owner_refs[name] = self._owner_refs.get(name, 0) + 1

    def _forget(self, remote: RemoteRegion) -> None:
        with self._meta_lock:
            if self._peers.pop(remote.key, None) is None:
                return
            refs = self._owner_refs[remote.owner] - 1
            if refs:
                self._owner_refs[remote.owner] = refs
                return
            del self._owner_refs[remote.owner]
            self._remove_agent(remote.owner)

    def _remove_agent(self, name: str) -> None:
        """Unload a remote agent (its endpoints close); the caller holds `_meta_lock`."""
        try:
            with self._gate.exclusive():
                self._agent.remove_remote_agent(name)
        except self._errors as err:
            log.warning("NIXL could not remove remote agent %r: %s", name, err)

    def _order_after(self, event: torch.cuda.Event) -> None:
        self._after = event  # `_submit`, next in the same locked call, hands it to the write's worker

    def _submit(
        self, transfer_id: int, src: LocalRegion, dst: RemoteRegion, slices: Sequence[Slice], bound: WriteBound
    ) -> str:
        after, self._after = self._after, None
        peer = self._peers[dst.key]
        where = _Place(peer.memory, peer.device)
        write = _Write(
            transfer_id, dst.owner, src.address, peer.address, _Place.of(src.tensor), where, tuple(slices), bound, after
        )
        self._writer.submit(write)
        return ""

    def _run(self, write: _Write) -> Completion:
        """On a worker thread: wait for the write's `after` event, then post it piece by piece as its bound allows,
        waiting for each."""
        gone = False
        if write.after is not None:
            write.after.synchronize()

        def post(piece: tuple[Slice, ...], post_by: PostBy) -> str:
            nonlocal gone
            reason, gone = self._post(write, piece, post_by)
            return reason

        reason = write.bound.move(write.slices, post)
        if reason:
            log.warning("transfer %d: %s", write.transfer_id, reason)
        return Completion(write.transfer_id, not reason, reason, write.ops, peer_gone=gone)

    def _post(self, write: _Write, piece: tuple[Slice, ...], post_by: PostBy) -> tuple[str, bool]:
        """Post one piece unless `post_by` has passed by then, wait for NIXL to finish it (or the timeout), release
        its handle: why it failed (or "") and whether NIXL said the peer is gone."""
        handle = None
        try:
            with self._gate.posting():
                local, remote = write.rows(piece)
                local_descs = self._agent.get_xfer_descs(local, write.src_place.memory)
                remote_descs = self._agent.get_xfer_descs(remote, write.dst_place.memory)
                handle = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, write.owner)
                if post_by.passed(time.monotonic()):
                    return post_by.reason, False
                state = self._agent.transfer(handle)
                late = time.monotonic() - post_by.at if post_by.at is not None else 0.0
            if late > 0:
                log.warning(
                    "transfer %d: posting a piece to %r returned %.3f s after the piece's deadline: if this process "
                    "was paused inside the post (the GIL held elsewhere, a stop), its bytes may land after decode "
                    "released their space",
                    write.transfer_id,
                    write.owner,
                    late,
                )
            return self._wait(handle, state, write.owner), False
        except self._errors as err:
            return f"nixl write to {write.owner!r} failed: {type(err).__name__} {err}", isinstance(
                err, self._disconnected
            )
        finally:
            self._release(handle)

    def _wait(self, handle: Any, state: str, owner: str) -> str:
        """Empty once the write is done, else why it failed; polls every `_POLL_S` up to the write timeout."""
        deadline = time.monotonic() + self.config.write_timeout_s
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                return f"nixl write to {owner!r} timed out after {self.config.write_timeout_s:.0f} s"
            time.sleep(_POLL_S)
            state = self._agent.check_xfer_state(handle)
        return "" if state == "DONE" else f"nixl write to {owner!r} failed in the backend (peer dead or disconnected?)"

    def _progress(self) -> list[Completion]:
        return self._writer.drain()

    def _release(self, handle: Any) -> None:
        if handle is None:
            return
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors as err:
            log.warning("NIXL could not release a transfer handle: %s", err)

    def _close(self) -> None:
        self._writer.stop()
        for region in list(self._regions.values()):
            self._unregister(region)
        with self._meta_lock:  # after an import under way: it finds the agent gone and fails
            for owner in list(self._owner_refs):
                self._remove_agent(owner)
            self._owner_refs.clear()
            self._peers.clear()
            self._agent = None  # destroy the NIXL agent now, not during interpreter shutdown (which can crash UCX)
