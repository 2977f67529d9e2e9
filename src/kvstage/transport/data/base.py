"""The data-transport interface: one-sided bulk writes from a prefill writer into a decode reader's memory.

Owns: the `DataTransport` base class every backend (local, mooncake, nixl) implements, the handle types it hands
out (`LocalRegion`, `RemoteRegion`), the wire form of a region (`RegionDescriptor`), the completion record
(`Completion`), and the bookkeeping every backend shares: transfer ids, bounds checks, operation counts and the
queue of completions.

Primitives, and who calls each (the runtime agents own one transport per rank and call it from their reactor
thread; every method is nonetheless safe to call from any thread):

| primitive                                   | side    | called by                                          |
|---------------------------------------------|---------|----------------------------------------------------|
| `allocate(nbytes, device=) -> LocalRegion`  | both    | decode: staging ring and KV pool; prefill: staging |
| `staging_device(kv_device) -> device`       | both    | where the agents put their ring and staging slab   |
| `register(tensor) -> LocalRegion`           | both    | to expose memory the caller already owns           |
| `register_address(addr, n) -> LocalRegion`  | both    | the same, for memory known only by address         |
| `export(region) -> RegionDescriptor`        | reader  | decode, when it registers its ring with writers    |
| `import_remote(desc) -> RemoteRegion`       | writer  | prefill, on receiving a decode rank's descriptor   |
| `write(src, src_off, dst, dst_off, n)`      | writer  | prefill, one bulk write per (chunk, decode rank)   |
| `write_batch(src, dst, [(s, d, n), ...])`   | writer  | prefill (direct path), the per-slice baseline      |
| `poll() -> list[Completion]`                | writer  | prefill's reactor, every turn                      |
| `forget_remote(remote)` / `unregister(r)`   | both    | when a peer session ends / a region is retired     |
| `close()`                                   | both    | agent shutdown                                     |

Writes are one-sided: the reader never learns from the transport that bytes landed. The writer learns it from a
`Completion` and tells the reader over the control plane (ChunkReady).

Bounded writes (the writer lease, docs/transports.md). `write`/`write_batch` take `not_after` (a `time.monotonic()`
reading): no byte of the write moves unless the backend starts moving it before then; checked again at the last
moment (on the worker thread, right before the copy or the post), else the write completes failed with reason
`LEASE_EXPIRED`. With `TransportConfig.max_write_s` set, a write moves in pieces of at most `PIECE_BYTES` and no
piece starts half of `max_write_s` or more after the write started (the rest fails as `WRITE_CUT`), which leaves
the last piece the other half to land; nixl also sets UCX's own timeouts from it. What a backend cannot bound
once bytes are posted is listed in docs/transports.md.

Invariants:
- every transfer id returned by `write`/`write_batch` appears in exactly one `Completion` from `poll`;
- a transport error never raises out of `write`, `write_batch` or `poll`: it becomes `Completion(ok=False,
  reason=...)`, with `peer_gone=True` when the backend knows the peer itself is gone. A write outside either
  region, or through an unknown or forgotten handle, fails this way before any byte moves; a write to a dead,
  closed or unreachable peer fails as soon as the backend notices. Only misuse of the API itself raises
  (negative offsets, an empty batch, a call after `close`);
- a write whose `not_after` has passed when it would start moves no byte and completes with `LEASE_EXPIRED`;
- `ops_issued` counts transfer operations handed to the backend: 1 per `write`, `len(slices)` per
  `write_batch`. The bench reports it as "transfer operations per request";
- a descriptor decoded from the wire is bounded (`MAX_DESCRIPTOR_PAYLOAD`) before anything is allocated for it;
- registered regions of one transport must not overlap (Mooncake refuses overlapping registrations);
- GPU memory: only a backend with `device_memory` (cuda_ipc, nixl) allocates or registers it; `staging_device` is the
  KV's GPU for such a backend and the host otherwise, so the agents' staging falls back to host memory;
- `write_batch(..., after=event)`: the writes start only after that CUDA event (the gather that filled the
  source): ordered on the device (`orders_on_device`), or waited for first.

A backend whose Python package is missing raises `kvstage.errors.TransportUnavailable` from its constructor,
naming the pip extra. Backends subclass `DataTransport` and implement the `_`-prefixed hooks only.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec
import torch

from kvstage.errors import ConfigError, ProtocolError, TransportError
from kvstage.protocol.reasons import LEASE_EXPIRED  # the room's failure reason too

MAX_DESCRIPTOR_PAYLOAD = 1 << 20
"""Upper bound, in bytes, of a descriptor's backend payload accepted from the wire (NIXL metadata is the largest)."""

MAX_NAME_LEN = 256
"""Upper bound of an agent name accepted from the wire."""

BACKENDS = ("local", "mooncake", "nixl", "cuda_ipc")

WRITE_CUT = "write cut: half of max_write_s had passed since it started, the rest was not sent"
"""Reason of a bounded write stopped between two pieces (the pieces before it may have landed)."""

PIECE_BYTES = 8 << 20
"""Most bytes a write bounded by `max_write_s` moves between two looks at the clock (about a millisecond of copy)."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How to build a data transport; `create_transport(config)` turns it into a backend instance.

    `name` identifies this agent to its peers and must be unique per process session (default: a fresh one).
    `host` is the address peers use to reach this agent (mooncake, nixl). The `mooncake_*` fields select
    Mooncake's transport ("tcp" by default, "rdma" with `mooncake_device`, e.g. "mlx5_0") and metadata service
    ("P2PHANDSHAKE": no central service). `nixl_backend` names the NIXL backend plugin; `nixl_rdma=False` keeps
    UCX off its InfiniBand modules, `nixl_progress_delay_us` paces NIXL's progress thread and `nixl_workers` is the
    number of UCX workers, i.e. of writes that copy at once (see `kvstage.transport.data.nixl`). `shm_dir` is where the
    local backend puts its shared-memory segments. `write_timeout_s` is how long a NIXL worker waits for a posted
    write before reporting it failed (Mooncake's binding waits `MC_TRANSFER_TIMEOUT`, 30 s by default); neither
    stops bytes already posted. `max_write_s` (None: unbounded) bounds every write's lifetime: no piece of a write
    starts half of `max_write_s` or more after the write started, and nixl sets UCX's transport timeouts from it
    (docs/transports.md says what each backend bounds and what it cannot).
    """

    backend: str = "local"
    name: str = field(default_factory=lambda: f"kvs-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    nixl_backend: str = "UCX"
    nixl_rdma: bool = False
    nixl_progress_delay_us: int = 100
    nixl_workers: int = 4
    shm_dir: str = "/dev/shm"
    write_timeout_s: float = 60.0
    max_write_s: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown transport backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if not self.name or len(self.name) > MAX_NAME_LEN:
            raise ConfigError(f"transport name must be 1..{MAX_NAME_LEN} characters, got {len(self.name)}")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake_protocol must be 'tcp' or 'rdma', got {self.mooncake_protocol!r}")
        if self.nixl_progress_delay_us < 0:
            raise ConfigError(f"nixl_progress_delay_us must be >= 0, got {self.nixl_progress_delay_us}")
        if self.nixl_workers < 1:
            raise ConfigError(f"nixl_workers must be at least 1, got {self.nixl_workers}")
        if self.write_timeout_s <= 0:
            raise ConfigError(f"write_timeout_s must be positive, got {self.write_timeout_s}")
        if self.max_write_s is not None and self.max_write_s <= 0:
            raise ConfigError(f"max_write_s must be positive (or None), got {self.max_write_s}")


class RegionDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Serialisable description of a registered region, sent by the reader to its writers.

    `owner` is the exporting agent's name, `region_id` its local id for the region, `nbytes` its size, and
    `payload` whatever the backend needs to reach it (segment name, session and address, NIXL metadata).
    """

    backend: str
    owner: str
    region_id: int
    nbytes: int
    payload: bytes


_DESCRIPTOR_ENCODER = msgspec.msgpack.Encoder()
_DESCRIPTOR_DECODER = msgspec.msgpack.Decoder(RegionDescriptor)


def encode_descriptor(descriptor: RegionDescriptor) -> bytes:
    """Msgpack bytes of `descriptor`, for embedding in a control message or bootstrap record."""
    return _DESCRIPTOR_ENCODER.encode(descriptor)


def decode_descriptor(data: bytes) -> RegionDescriptor:
    """Decode and bound-check a descriptor from the wire; raises `ProtocolError` if it is malformed or too big."""
    if len(data) > MAX_DESCRIPTOR_PAYLOAD + 4096:
        raise ProtocolError(f"region descriptor of {len(data)} bytes exceeds the limit {MAX_DESCRIPTOR_PAYLOAD}")
    try:
        descriptor = _DESCRIPTOR_DECODER.decode(data)
    except msgspec.DecodeError as err:
        raise ProtocolError(f"malformed region descriptor: {err}") from err
    check_descriptor(descriptor)
    return descriptor


def check_descriptor(descriptor: RegionDescriptor) -> None:
    """Raise `ProtocolError` unless every field of `descriptor` is within bounds."""
    if descriptor.backend not in BACKENDS:
        raise ProtocolError(f"region descriptor names unknown backend {descriptor.backend!r}")
    if not 0 < len(descriptor.owner) <= MAX_NAME_LEN:
        raise ProtocolError(f"region descriptor owner name length {len(descriptor.owner)} out of range")
    if descriptor.region_id < 0 or descriptor.nbytes <= 0:
        raise ProtocolError(f"region descriptor has region_id={descriptor.region_id} nbytes={descriptor.nbytes}")
    if len(descriptor.payload) > MAX_DESCRIPTOR_PAYLOAD:
        raise ProtocolError(f"region descriptor payload of {len(descriptor.payload)} bytes exceeds the limit")


@dataclass(frozen=True, slots=True, eq=False)
class LocalRegion:
    """A registered local region: `tensor` is a flat uint8 view of exactly its bytes (on the CPU, or on a GPU for
    a backend with `device_memory`)."""

    region_id: int
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A peer's region imported from its descriptor; `key` is this transport's handle for the import."""

    key: int
    owner: str
    region_id: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Completion:
    """Outcome of one transfer id: `ok`, or a failure with a human-readable `reason`; `ops` operations it held.

    `peer_gone` is the transport's cause of a failure, where the backend knows it: the peer's process or session
    is gone (local: the owner pid exited or released the segment; nixl: NIXL_ERR_REMOTE_DISCONNECT; mooncake:
    the owner's pid exited, when it runs on this host, else nothing listens on its handshake port any more). The
    writer then fails the room as "peer dead"."""

    transfer_id: int
    ok: bool
    reason: str
    ops: int
    peer_gone: bool = False


Slice = tuple[int, int, int]
"""(local_offset, remote_offset, length) of one write within a (LocalRegion, RemoteRegion) pair."""


@dataclass(frozen=True, slots=True)
class PostBy:
    """When (`time.monotonic()`; None: never) one piece of a write may no longer start, and the reason then
    (`LEASE_EXPIRED` or `WRITE_CUT`); checked by `WriteBound.move` and again right before the post (nixl)."""

    at: float | None
    reason: str

    def passed(self, now: float) -> bool:
        return self.at is not None and now >= self.at


@dataclass(frozen=True, slots=True)
class WriteBound:
    """When one write may move bytes: it starts only before `not_after` (`time.monotonic()`; None: any time), and
    once started no piece of it starts half of `max_write_s` or more later (None: it is never cut), so that the last
    piece has the other half to land."""

    not_after: float | None = None
    max_write_s: float | None = None

    def expired(self, now: float) -> bool:
        """Whether a write that has not started may no longer start at `now`."""
        return self.not_after is not None and now >= self.not_after

    def pieces(self, slices: Sequence[Slice], max_slices: int = 0) -> Iterator[tuple[Slice, ...]]:
        """`slices` in order, in groups of at most `max_slices` slices (0: any number) and, when the write is
        bounded by `max_write_s`, of at most `PIECE_BYTES` bytes (a longer slice is split)."""
        limit = PIECE_BYTES if self.max_write_s is not None else 0
        piece: list[Slice] = []
        size = 0
        for s_off, d_off, length in slices:
            done = 0
            while done < length:
                take = length - done if not limit else min(length - done, limit - size)
                piece.append((s_off + done, d_off + done, take))
                size, done = size + take, done + take
                if (limit and size >= limit) or len(piece) == max_slices:
                    yield tuple(piece)
                    piece, size = [], 0
        if piece:
            yield tuple(piece)

    def move(
        self, slices: Sequence[Slice], move_piece: Callable[[tuple[Slice, ...], PostBy], str], max_slices: int = 0
    ) -> str:
        """Move `slices` piece by piece with `move_piece(piece, post_by)` ("" or why it failed), on the thread that
        moves the bytes: `LEASE_EXPIRED` before the first piece if `not_after` has passed, `WRITE_CUT` before a
        later one once half of `max_write_s` has; otherwise the first failure, or "" when every piece moved."""
        cut_at = None if self.max_write_s is None else time.monotonic() + self.max_write_s / 2
        for index, piece in enumerate(self.pieces(slices, max_slices)):
            post_by = PostBy(cut_at, WRITE_CUT) if index else PostBy(self.not_after, LEASE_EXPIRED)
            if post_by.passed(time.monotonic()):
                return post_by.reason
            if reason := move_piece(piece, post_by):
                return reason
        return ""


class DataTransport(ABC):
    """Base of every data backend. Public methods are final; backends implement the `_` hooks, which run with the
    transport's lock held, and must not block for long:
    - `_register(tensor, region_id)`: make `tensor` usable as a source or target (pin, register with the NIC);
    - `_allocate(nbytes, region_id, pinned) -> tensor`: memory a peer can write into (default: a fresh tensor,
      page-locked for CUDA when `pinned`); `_allocate_device(nbytes, device) -> tensor`: the same on a GPU
      (backends with `device_memory` only);
    - `_order_after(event)`: the next writes start after a CUDA event (default: wait for it);
    - `_unregister(region)`, `_export_payload(region) -> bytes`, `_import(desc, key)`, `_forget(remote)`;
    - `_submit(transfer_id, src, dst, slices, bound) -> str`: start the writes, moving their bytes only as
      `bound` allows (`WriteBound.move` on the thread that moves them); return "" or a failure reason;
    - `_progress() -> list[Completion]`: completions of submitted transfers since the last call;
    - `_close()`: release backend resources.
    """

    backend: ClassVar[str]
    #: Whether registering host memory with the backend already page-locks it for CUDA; `allocate(pinned=True)`
    #: then leaves page-locking to the backend (CUDA refuses to page-lock the same memory twice).
    pins_for_cuda: ClassVar[bool] = False
    #: Whether the backend moves GPU memory: `allocate(device="cuda:N")` and `register` of GPU tensors.
    device_memory: ClassVar[bool] = False
    orders_on_device: ClassVar[bool] = False  #: `after` is waited for on the device (cuda_ipc), not the host
    #: Whether the backend connects to a peer when its region is imported and never again by itself, so that a
    #: connection that failed while the peer lives (a write `peer_gone` to a peer that still answers) is made again
    #: only by forgetting every region of that peer and importing them anew (nixl: a failed UCX endpoint).
    reconnects_on_import: ClassVar[bool] = False
    #: Whether `_import` may block for long (NIXL connects to the peer inside it: seen taking 11 s) and therefore
    #: runs outside the transport's lock, the backend guarding its own tables: writes, polls and forgets go on
    #: meanwhile on other threads.
    imports_unlocked: ClassVar[bool] = False

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.name = config.name
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._regions: dict[int, LocalRegion] = {}
        self._remotes: dict[int, RemoteRegion] = {}
        self._ready: list[Completion] = []
        self._in_flight: set[int] = set()
        self._ops_issued = 0
        self._closed = False
        self._wake: Callable[[], None] | None = None

    # ---- memory -------------------------------------------------------------------------------------------
    def allocate(self, nbytes: int, pinned: bool = False, device: str | torch.device = "cpu") -> LocalRegion:
        """Allocate and register `nbytes` of zeroed memory that peers can write into (ring, staging).

        `device` is where: the host, or a GPU for a backend with `device_memory` (else `TransportError`).
        `pinned` asks for host memory page-locked for CUDA, for copies to and from a GPU at DMA speed. It is a
        hint: ignored without CUDA, and by backends that cannot (local: shared-memory files) or that page-lock
        registered memory themselves (`pins_for_cuda`)."""
        if nbytes <= 0:
            raise ValueError(f"allocate needs a positive size, got {nbytes}")
        where = torch.device(device)
        if where.type != "cpu" and not self.device_memory:
            raise TransportError(f"the {self.backend} backend moves host memory only; it cannot allocate on {where}")
        with self._lock:
            self._check_open()
            region_id = next(self._ids)
            if where.type == "cpu":
                region = LocalRegion(region_id, self._allocate(nbytes, region_id, pinned))
            else:
                region = LocalRegion(region_id, self._allocate_device(nbytes, where))
            self._regions[region_id] = region
            return region

    def staging_device(self, kv_device: torch.device) -> torch.device:
        """Where a rank whose KV is on `kv_device` keeps its staging (decode ring, prefill slab): on that GPU when
        this backend moves GPU memory (`device_memory`), else in host memory (the fallback)."""
        return kv_device if kv_device.type == "cuda" and self.device_memory else torch.device("cpu")

    def register(self, tensor: torch.Tensor) -> LocalRegion:
        """Register caller-owned memory (a contiguous tensor, viewed as bytes) and return its handle.

        The caller keeps `tensor` alive until `unregister`. The cuda_ipc backend can export only memory from
        `allocate` (the local backend exports caller memory through cross-memory writes); a registered tensor can
        always be a write source. GPU tensors only with `device_memory`.
        """
        flat = _as_bytes(tensor, self.device_memory)
        with self._lock:
            self._check_open()
            region_id = next(self._ids)
            region = LocalRegion(region_id, flat)
            self._register(region)
            self._regions[region_id] = region
            return region

    def register_address(self, address: int, nbytes: int) -> LocalRegion:
        """Register raw CPU memory `[address, address + nbytes)` from another allocator; the caller keeps it alive
        and mapped until `unregister`. Same rules as `register`."""
        if address <= 0 or nbytes <= 0:
            raise ValueError(f"register_address needs a positive address and size, got {address:#x}, {nbytes}")
        view = (ctypes.c_uint8 * nbytes).from_address(address)
        return self.register(torch.frombuffer(view, dtype=torch.uint8))

    def unregister(self, region: LocalRegion) -> None:
        """Retire a region: later writes from it fail; idempotent. Writes still in flight are not cancelled."""
        with self._lock:
            if self._regions.pop(region.region_id, None) is not None:
                self._unregister(region)

    # ---- descriptors ---------------------------------------------------------------------------------------
    def export(self, region: LocalRegion) -> RegionDescriptor:
        """Descriptor of a registered region, for the peers that will write into it."""
        with self._lock:
            self._check_open()
            self._known_region(region)
            payload = self._export_payload(region)
            return RegionDescriptor(self.backend, self.name, region.region_id, region.nbytes, payload)

    def import_remote(self, descriptor: RegionDescriptor) -> RemoteRegion:
        """Handle for a peer's region; raises `TransportError` if the peer cannot be reached or parsed."""
        check_descriptor(descriptor)
        if descriptor.backend != self.backend:
            raise TransportError(f"descriptor is for backend {descriptor.backend!r}, this is {self.backend!r}")
        with self._lock:
            self._check_open()
            remote = RemoteRegion(next(self._ids), descriptor.owner, descriptor.region_id, descriptor.nbytes)
            if not self.imports_unlocked:
                self._import(descriptor, remote)
                self._remotes[remote.key] = remote
                return remote
        self._import(descriptor, remote)
        with self._lock:
            self._check_open()  # closed meanwhile: `_close` forgot what the import loaded
            self._remotes[remote.key] = remote
            return remote

    def forget_remote(self, remote: RemoteRegion) -> None:
        """Drop an imported region (peer session ended); later writes to it fail. Idempotent."""
        with self._lock:
            if self._remotes.pop(remote.key, None) is not None:
                self._forget(remote)

    # ---- writes --------------------------------------------------------------------------------------------
    def write(
        self,
        src: LocalRegion,
        src_offset: int,
        dst: RemoteRegion,
        dst_offset: int,
        length: int,
        *,
        not_after: float | None = None,
    ) -> int:
        """Start one write of `src[src_offset:+length]` into `dst[dst_offset:+length]`; returns its transfer id."""
        return self.write_batch(src, dst, ((src_offset, dst_offset, length),), not_after=not_after)

    def write_batch(
        self,
        src: LocalRegion,
        dst: RemoteRegion,
        slices: Sequence[Slice],
        after: torch.cuda.Event | None = None,
        *,
        not_after: float | None = None,
    ) -> int:
        """Start one write per slice between one region pair; one transfer id completes when all have landed.

        `after`: a CUDA event the writes are ordered after (the gather that filled `src`); see `_order_after`.
        `not_after` (a `time.monotonic()` reading, None: no limit): the write moves no byte unless it starts before
        then, checked here and again right before its first byte moves; else it fails with `LEASE_EXPIRED`."""
        if not slices:
            raise ValueError("write_batch needs at least one slice")
        for s_off, d_off, length in slices:
            if length <= 0 or s_off < 0 or d_off < 0:
                raise ValueError(f"invalid slice ({s_off}, {d_off}, {length})")
        with self._lock:
            self._check_open()
            transfer_id = next(self._ids)
            bound = WriteBound(not_after, self.config.max_write_s)
            reason = LEASE_EXPIRED if bound.expired(time.monotonic()) else self._precheck(src, dst, slices)
            if not reason:
                if after is not None:
                    self._order_after(after)
                self._ops_issued += len(slices)
                reason = self._submit(transfer_id, src, dst, slices, bound)
            if reason:
                self._ready.append(Completion(transfer_id, False, reason, len(slices)))
                self._completed()
            else:
                self._in_flight.add(transfer_id)
            return transfer_id

    def on_completion(self, wake: Callable[[], None]) -> None:
        """Have `wake()` called, from any thread, whenever a completion becomes ready for `poll`, so the caller can
        sleep until then instead of polling. `wake` must be quick and must not call back into the transport."""
        self._wake = wake

    def _completed(self) -> None:
        """Backends call this (from any thread) after making a completion ready for `_progress`."""
        wake = self._wake
        if wake is not None:
            wake()

    def poll(self) -> list[Completion]:
        """Completions (successes and failures) since the last call, in no particular order. Never raises."""
        with self._lock:
            if not self._closed:
                for completion in self._progress():
                    self._in_flight.discard(completion.transfer_id)
                    self._ready.append(completion)
            ready, self._ready = self._ready, []
            return ready

    @property
    def ops_issued(self) -> int:
        """Transfer operations handed to the backend so far (1 per write, one per slice of a batch)."""
        return self._ops_issued

    @property
    def in_flight(self) -> int:
        """Transfers submitted and not yet reported by `poll`."""
        return len(self._in_flight)

    def close(self) -> None:
        """Release everything. Transfers still in flight are reported failed by the next `poll`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for transfer_id in sorted(self._in_flight):
                self._ready.append(Completion(transfer_id, False, "transport closed with the write in flight", 0))
            self._in_flight.clear()
            self._close()
            self._regions.clear()
            self._remotes.clear()

    def __enter__(self) -> DataTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- shared checks -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.backend} transport {self.name!r} is closed")

    def _known_region(self, region: LocalRegion) -> None:
        if self._regions.get(region.region_id) is not region:
            raise TransportError(f"local region {region.region_id} is not registered with {self.name!r}")

    def _precheck(self, src: LocalRegion, dst: RemoteRegion, slices: Sequence[Slice]) -> str:
        """Reason why this batch cannot be submitted, or "" if it can."""
        if self._regions.get(src.region_id) is not src:
            return f"local region {src.region_id} is not registered"
        if self._remotes.get(dst.key) != dst:
            return f"remote region {dst.region_id} of {dst.owner!r} is not imported (forgotten or never imported)"
        for s_off, d_off, length in slices:
            if s_off + length > src.nbytes:
                return f"source slice [{s_off}, {s_off + length}) is outside the local region of {src.nbytes} bytes"
            if d_off + length > dst.nbytes:
                return (
                    f"destination slice [{d_off}, {d_off + length}) is outside remote region {dst.region_id} "
                    f"of {dst.owner!r} ({dst.nbytes} bytes)"
                )
        return ""

    # ---- backend hooks -------------------------------------------------------------------------------------
    def _order_after(self, event: torch.cuda.Event) -> None:
        """Make the next writes start after `event`. Host backends read host memory that the gather filled, so they
        wait for it here (a host-staging gather has landed before it reports, so this returns at once)."""
        event.synchronize()

    def _allocate_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        raise TransportError(f"the {self.backend} backend cannot allocate GPU memory")

    def _allocate(self, nbytes: int, region_id: int, pinned: bool) -> torch.Tensor:
        pin = pinned and not self.pins_for_cuda and torch.cuda.is_available()
        tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._register(LocalRegion(region_id, tensor))
        return tensor

    @abstractmethod
    def _register(self, region: LocalRegion) -> None: ...

    @abstractmethod
    def _unregister(self, region: LocalRegion) -> None: ...

    @abstractmethod
    def _export_payload(self, region: LocalRegion) -> bytes: ...

    @abstractmethod
    def _import(self, descriptor: RegionDescriptor, remote: RemoteRegion) -> None: ...

    @abstractmethod
    def _forget(self, remote: RemoteRegion) -> None: ...

    @abstractmethod
    def _submit(
        self, transfer_id: int, src: LocalRegion, dst: RemoteRegion, slices: Sequence[Slice], bound: WriteBound
    ) -> str: ...

    @abstractmethod
    def _progress(self) -> list[Completion]: ...

    @abstractmethod
    def _close(self) -> None: ...


def _as_bytes(tensor: torch.Tensor, device_memory: bool) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor, sharing its memory; a GPU tensor only where `device_memory`."""
    if tensor.device.type != "cpu" and not device_memory:
        raise ValueError(f"this data transport registers CPU memory; got a tensor on {tensor.device}")
    if not tensor.is_contiguous() or tensor.numel() == 0:
        raise ValueError("data transports register non-empty contiguous tensors only")
    return tensor.reshape(-1).view(torch.uint8)
