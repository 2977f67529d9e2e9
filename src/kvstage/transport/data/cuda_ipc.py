"""The `cuda_ipc` data backend: same-host, one-sided GPU-to-GPU writes through CUDA IPC memory handles.

Owns: the GPU regions from `allocate(device="cuda:N")` (one cudaMalloc each, so that an IPC handle names exactly
that allocation), the peers' allocations opened from their handles, one CUDA stream per source GPU on which this
writer's copies run, and the CUDA event of each write in flight.

How it works. `allocate` takes a fresh cudaMalloc allocation, zeroes it and hands out a uint8 tensor over it. Its
descriptor carries the allocation's IPC handle (`cudaIpcGetMemHandle`), its size, the UUID of its GPU and the
owner's pid. A writer opens the handle on that GPU (`cudaIpcOpenMemHandle`, peer access enabled lazily, so a writer
whose KV is on another GPU of the host writes peer to peer) and checks the real size of what it mapped
(`cuMemGetAddressRange`) against the descriptor before any write. A write is queued by the caller's own thread (the
agent's reactor) inside `write_batch`, with no thread of this transport in between and no host wait: the writer's
stream waits on the device for the write's `after` event (the gather that filled the source), `not_after` is
checked as the copies are queued, and one bounded copy per slice (`bounded_copy`) follows on the writer's stream,
then a CUDA event; `poll` asks each event (`query`, never a wait), so a completion never blocks the caller.

The hard bound on late copies. Each copy carries a device-clock deadline, the earlier of `not_after` (the writer's
lease) and `max_write_s` after it was queued (the transports' rule: a posted write lands within `max_write_s` or
never): a program of the copy that the device reaches after it stores nothing, and the write then completes failed
(`LATE_ON_DEVICE`), however long the GPU was held (a gather still running, a backed-up stream, a stalled peer
kernel). So a write checked against its lease on the host, and reached by the device only after the lease ran out,
lands no byte, and none lands in ring space decode may have granted again. The device's count of skipped programs
comes back through a page-locked counter taken from a pool (`_Counters`), not a fresh allocation per write. Within
one process a handle cannot be opened (CUDA refuses its own handles), so there the region is found in this
process's table of exported regions.

Memory lifetime. An allocation is freed (cudaFree), and an opened handle closed, when the last tensor over it is
garbage-collected, never explicitly, so a copy still queued never touches freed memory (local.py does the same
with its mappings).

Invariants: a write to a peer whose process has exited fails with `peer_gone` before anything is queued; a slice
outside either region, or a descriptor larger than the allocation behind its handle, fails before any byte moves;
a CUDA error becomes a failed completion. Handles are not authenticated (docs/security.md): a process of the host
that may use the GPU and learns a descriptor can write into the region, as with the local backend's segments.
Called through `kvstage.transport.data.create_transport`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

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
from kvstage.transport.data.local import ProcessWatch

if TYPE_CHECKING:
    from kvstage.transport.data.bounded_copy import DeviceClock

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64
#: Reason of a write some of whose copies the device reached after their deadline (those stored nothing).
LATE_ON_DEVICE = "write cut on the device: the GPU reached its copy after max_write_s; nothing was stored past it"
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Payload of a cuda_ipc descriptor: the allocation's IPC handle and size, its GPU's UUID, the owner's pid."""

    handle: bytes
    size: int
    gpu: str
    pid: int


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class _Cuda:
    """The CUDA runtime and driver calls that torch does not expose: allocations, IPC handles, address ranges.

    Uses the CUDA runtime library torch itself loaded, so both share the device's primary context."""

    def __init__(self) -> None:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        self.rt = _load_library("libcudart", ("libcudart.so.13", "libcudart.so.12", "libcudart.so"))
        self.drv = _load_library("libcuda", ("libcuda.so.1", "libcuda.so"))
        self.rt.cudaGetErrorString.restype = ctypes.c_char_p
        self.rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            message = self.rt.cudaGetErrorString(rc).decode()
            raise TransportError(f"{what} failed: CUDA error {rc} ({message})")

    def malloc(self, nbytes: int, device: torch.device) -> int:
        ptr = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(self.rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), f"cudaMalloc of {nbytes} B")
        assert ptr.value is not None
        return ptr.value

    def free(self, ptr: int) -> None:
        _ignore_at_exit(self.rt.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def handle(self, ptr: int) -> bytes:
        handle = _Handle()
        self._check(self.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return bytes(handle.reserved)

    def open(self, handle: bytes, device: torch.device) -> tuple[int, int]:
        """(address, size of the allocation) of a peer's handle, mapped on `device`."""
        raw = _Handle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
        ptr, base, size = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t()
        with torch.cuda.device(device):
            self._check(self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle")
            assert ptr.value is not None
            rc = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr.value))
        if rc != 0:
            self.close(ptr.value)
            raise TransportError(f"cuMemGetAddressRange of an opened IPC handle failed: CUDA driver error {rc}")
        return ptr.value, size.value

    def close(self, ptr: int) -> None:
        _ignore_at_exit(self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def _load_library(stem: str, names: tuple[str, ...]) -> ctypes.CDLL:
    """The copy of `stem` this process already mapped (torch's), else the first of `names` that loads."""
    maps = Path("/proc/self/maps")
    mapped = maps.read_text().splitlines() if maps.exists() else []
    paths = [line.split()[-1] for line in mapped if f"/{stem}.so" in line]
    for name in (*paths[:1], *names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise TransportUnavailable(f"the cuda_ipc backend needs the CUDA library {stem} ({', '.join(names)})")


def _ignore_at_exit(rc: int, what: str) -> None:
    """Release calls run from finalizers, also at interpreter exit when CUDA may already be torn down."""
    if rc != 0:
        log.debug("%s returned CUDA error %d (at exit, CUDA may already be unloaded)", what, rc)


_CUDA: _Cuda | None = None
_CUDA_LOCK = threading.Lock()


def _cuda() -> _Cuda:
    global _CUDA
    with _CUDA_LOCK:
        if _CUDA is None:
            _CUDA = _Cuda()
        return _CUDA


class _DeviceMemory:
    """Owner of `nbytes` of device memory at `ptr`, seen by torch through `__cuda_array_interface__`;
    `release(ptr)` runs once the last tensor over it is gone."""

    def __init__(self, ptr: int, nbytes: int, release: Callable[[int], None]) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        weakref.finalize(self, release, ptr)

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the memory (on the GPU the memory is on); it keeps this owner alive."""
        return torch.as_tensor(self)


#: Regions exported by this process's transports, by (agent name, region id): a writer in the same process takes
#: the tensor from here, since CUDA does not open a process's own handles. An entry goes with its region.
_EXPORTED: dict[tuple[str, int], torch.Tensor] = {}
#: Peer allocations this process opened, by handle: CUDA maps a handle once per process, so imports share it.
_OPENED: weakref.WeakValueDictionary[bytes, _DeviceMemory] = weakref.WeakValueDictionary()
_TABLES = threading.Lock()


@dataclass(frozen=True, slots=True)
class _Owned:
    """An allocation of ours: its IPC handle, size and GPU."""

    handle: bytes
    size: int
    gpu: str


@dataclass(frozen=True, slots=True)
class _Target:
    """An imported region: a tensor over its bytes and its owner's pid."""

    tensor: torch.Tensor
    pid: int


@dataclass(frozen=True, slots=True)
class _Launch:
    """A write to queue: what to copy where, after which event, under which bound."""

    transfer_id: int
    after: torch.cuda.Event | None
    source: torch.Tensor
    target: torch.Tensor
    slices: tuple[Slice, ...]
    bound: WriteBound
    where: str  # "region N of 'owner'", for messages


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A write queued on a stream: its event, operations, the reason if queueing it failed part way, and (bounded
    copies) the counter slot of the device's count of programs that stored nothing past the deadline, how many
    programs it queued, and whether the deadline was the lease's (else `max_write_s` after the post)."""

    transfer_id: int
    event: torch.cuda.Event
    ops: int
    reason: str
    counter: tuple[_Counters, int] | None
    programs: int = 0
    lease_bound: bool = False


class _Counters:
    """Counters of skipped copy programs on one GPU, each mirrored in page-locked host memory, handed out to writes
    and taken back when their completion is seen. A new block of BLOCK slots is added when every slot is in use
    (so their number is bounded by the most writes ever in flight at once); blocks are never freed while the
    transport lives, since queued copies may still write them."""

    BLOCK = 64

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._blocks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device counts, page-locked host counts)
        self._free: list[int] = []

    def take(self) -> int:
        if not self._free:
            base = len(self._blocks) * self.BLOCK
            counts = torch.zeros(self.BLOCK, dtype=torch.int32, device=self._device)
            self._blocks.append((counts, torch.zeros(self.BLOCK, dtype=torch.int32, pin_memory=True)))
            self._free = list(range(base + self.BLOCK - 1, base - 1, -1))
        return self._free.pop()

    def device(self, slot: int) -> torch.Tensor:
        counts, _ = self._blocks[slot // self.BLOCK]
        return counts[slot % self.BLOCK : slot % self.BLOCK + 1]

    def publish(self, slot: int) -> None:
        """Queue the copy of the slot's count to the host (after the write's copies, on the current stream)."""
        _, host = self._blocks[slot // self.BLOCK]
        host[slot % self.BLOCK : slot % self.BLOCK + 1].copy_(self.device(slot), non_blocking=True)

    def give_back(self, slot: int) -> int:
        """The slot's final count (its write's event is done, or failed); the slot is free again."""
        _, host = self._blocks[slot // self.BLOCK]
        self._free.append(slot)
        return int(host[slot % self.BLOCK])


class CudaIpcTransport(DataTransport):
    """CUDA IPC backend: writers and readers on one host, regions in GPU memory."""

    backend = "cuda_ipc"
    device_memory = True
    orders_on_device = True

    def __init__(self, config: TransportConfig) -> None:
        if not torch.cuda.is_available():
            raise TransportUnavailable("the cuda_ipc backend needs a CUDA GPU, and torch sees none on this machine")
        try:
            from kvstage.transport.data import bounded_copy
        except ImportError as err:
            raise TransportUnavailable(f"the cuda_ipc backend needs Triton (in torch's CUDA builds): {err}") from err
        super().__init__(config)
        self._bounded = bounded_copy
        self._cuda = _cuda()
        self._owned: dict[int, _Owned] = {}
        self._targets: dict[int, _Target] = {}
        self._owners = ProcessWatch()  # is each target's owner alive (asked before every write)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._clocks: dict[int, DeviceClock] = {}
        self._counters: dict[int, _Counters] = {}
        self._after: torch.cuda.Event | None = None
        self._writes: list[_InFlight] = []
        self._failed: list[Completion] = []

    # ---- memory -------------------------------------------------------------------------------------------
    def _allocate(self, nbytes: int, region_id: int, pinned: bool) -> torch.Tensor:
        raise TransportError("the cuda_ipc backend moves GPU memory only: allocate(nbytes, device='cuda:N')")

    def _allocate_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        ptr = self._cuda.malloc(nbytes, device)
        memory = _DeviceMemory(ptr, nbytes, self._cuda.free)
        tensor = memory.tensor()
        try:
            handle = self._cuda.handle(ptr)
        except TransportError:
            del tensor, memory  # frees the allocation
            raise
        with torch.cuda.device(device):
            tensor.zero_()
            torch.cuda.current_stream(device).synchronize()  # at allocation only: peers write it on their streams
        self._owned[tensor.data_ptr()] = _Owned(handle, nbytes, str(torch.cuda.get_device_properties(device).uuid))
        if self.config.max_write_s is not None:
            self._clock(device)  # a staging slab is a write source: its device's clock and kernels, now
        return tensor

    def _register(self, region: LocalRegion) -> None:
        """Any tensor (GPU or host) can be a write source; only `allocate`d regions can be exported. A GPU source's
        device gets its clock (and the bounded copy its compiled kernels) now, not on the first write."""
        if region.tensor.is_cuda and self.config.max_write_s is not None:
            self._clock(region.tensor.device)

    def _unregister(self, region: LocalRegion) -> None:
        self._owned.pop(region.address, None)
        with _TABLES:
            _EXPORTED.pop((self.name, region.region_id), None)

    def _export_payload(self, region: LocalRegion) -> bytes:
        owned = self._owned.get(region.address)
        if owned is None:
            raise TransportError(
                f"the cuda_ipc backend can export only regions made by allocate(device=...); region "
                f"{region.region_id} was registered from caller memory"
            )
        with _TABLES:
            _EXPORTED[(self.name, region.region_id)] = region.tensor
        return msgspec.msgpack.encode(_IpcRef(owned.handle, owned.size, owned.gpu, os.getpid()))

    def _import(self, descriptor: RegionDescriptor, remote: RemoteRegion) -> None:
        ref = _decode_ref(descriptor)
        if ref.pid == os.getpid():
            with _TABLES:
                tensor = _EXPORTED.get((descriptor.owner, descriptor.region_id))
            if tensor is None or tensor.numel() < descriptor.nbytes:
                raise TransportError(
                    f"region {descriptor.region_id} of {descriptor.owner!r} is not exported in this process"
                )
        else:
            tensor = self._open(ref)
            if tensor.numel() < descriptor.nbytes:
                raise TransportError(
                    f"descriptor from {descriptor.owner!r} claims {descriptor.nbytes} bytes; its allocation has "
                    f"{tensor.numel()}"
                )
        self._targets[remote.key] = _Target(tensor[: descriptor.nbytes], ref.pid)
        self._owners.watch(ref.pid)

    def _open(self, ref: _IpcRef) -> torch.Tensor:
        """A tensor over the peer's whole allocation (its real size, as CUDA mapped it)."""
        with _TABLES:
            memory = _OPENED.get(ref.handle)
            if memory is None:
                ptr, size = self._cuda.open(ref.handle, _device_of(ref.gpu))
                memory = _DeviceMemory(ptr, size, self._cuda.close)
                _OPENED[ref.handle] = memory
        return memory.tensor()

    def _forget(self, remote: RemoteRegion) -> None:
        target = self._targets.pop(remote.key, None)
        if target is not None:
            self._owners.release(target.pid)

    # ---- writes --------------------------------------------------------------------------------------------
    def _order_after(self, event: torch.cuda.Event) -> None:
        self._after = event  # `_submit`, next in the same locked call, hands it to the launcher thread with the write

    def _submit(
        self, transfer_id: int, src: LocalRegion, dst: RemoteRegion, slices: Sequence[Slice], bound: WriteBound
    ) -> str:
        """Queue the write now, on the caller's thread (under the transport's lock); a write that fails here fails
        alone (logged, and completed with the reason)."""
        after, self._after = self._after, None
        target = self._targets[dst.key]
        if not self._owners.alive(target.pid):
            reason = f"peer dead: owner process {target.pid} of region {dst.region_id} of {dst.owner!r} has exited"
            self._fail(Completion(transfer_id, False, reason, len(slices), peer_gone=True))
            return ""
        where = f"region {dst.region_id} of {dst.owner!r}"
        launch = _Launch(transfer_id, after, src.tensor, target.tensor, tuple(slices), bound, where)
        try:
            self._writes.append(self._launch(launch))
        except Exception as err:  # CUDA, Triton or clock errors: this write fails, the caller goes on
            log.exception("transfer %d into %s failed", transfer_id, where)
            self._fail(Completion(transfer_id, False, f"cuda_ipc write into {where}: {err}", len(slices)))
        return ""

    def _fail(self, completion: Completion) -> None:
        self._failed.append(completion)
        self._completed()

    def _launch(self, launch: _Launch) -> _InFlight:
        """Queue the copies on the writer's stream after the gather's event, bounded on the device by the earlier of
        the lease and `max_write_s` from now, then the write's event; the lease is checked as they are queued."""
        source, target, bound = launch.source, launch.target, launch.bound
        device = source.device if source.is_cuda else target.device
        stream = self._stream(device)
        now = time.monotonic()
        cut = None if bound.max_write_s is None else now + bound.max_write_s
        ends = [t for t in (bound.not_after, cut) if t is not None]
        counter: tuple[_Counters, int] | None = None
        deadline, programs = 0, [0]
        if ends and source.is_cuda:
            deadline = self._clock(device).deadline_ns(min(ends))
            counters = self._counter_pool(device)
            counter = (counters, counters.take())

        def queue_piece(piece: tuple[Slice, ...], _: PostBy) -> str:
            for s_off, d_off, length in piece:
                src, dst = source[s_off : s_off + length], target[d_off : d_off + length]
                if counter is None:
                    dst.copy_(src, non_blocking=True)
                else:
                    programs[0] += self._bounded.bounded_copy(dst, src, deadline, counter[0].device(counter[1]))
            return ""

        with torch.cuda.stream(stream):
            if launch.after is not None:
                stream.wait_event(launch.after)  # on the device: no host wait between the gather and the copy
            if counter is not None:
                counter[0].device(counter[1]).zero_()
            reason = bound.move(launch.slices, queue_piece)  # `not_after` checked right before the first copy
            if counter is not None:
                counter[0].publish(counter[1])
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        lease_bound = bound.not_after is not None and (cut is None or bound.not_after <= cut)
        return _InFlight(launch.transfer_id, event, len(launch.slices), reason, counter, programs[0], lease_bound)

    def _counter_pool(self, device: torch.device) -> _Counters:
        index = torch.cuda.current_device() if device.index is None else device.index
        pool = self._counters.get(index)
        if pool is None:
            pool = self._counters[index] = _Counters(torch.device("cuda", index))
        return pool

    def _clock(self, device: torch.device) -> DeviceClock:
        """The clock of `device`, made on first use (at registration: `_register`)."""
        index = torch.cuda.current_device() if device.index is None else device.index
        clock = self._clocks.get(index)
        if clock is None:
            clock = self._clocks[index] = self._bounded.DeviceClock(torch.device("cuda", index))
        return clock

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """This writer's stream on `device` (one per GPU it writes from), made on first use."""
        index = torch.cuda.current_device() if device.index is None else device.index
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]
        return stream

    def _progress(self) -> list[Completion]:
        done, self._failed = self._failed, []
        still: list[_InFlight] = []
        for write in self._writes:
            try:
                landed = write.event.query()  # type: ignore[no-untyped-call]
            except RuntimeError as err:
                _skipped(write)
                done.append(Completion(write.transfer_id, False, f"cuda_ipc write failed on the device: {err}",
                                       write.ops))  # fmt: skip
                continue
            if landed:
                reason = write.reason or _late(write, _skipped(write), self._bounded.PROGRAM_BYTES)
                done.append(Completion(write.transfer_id, not reason, reason, write.ops))
            else:
                still.append(write)
        self._writes = still
        return done

    def _close(self) -> None:
        writes, self._writes = self._writes, []
        for write in writes:  # shutdown only: copies still queued end before their memory can go
            write.event.synchronize()
        self._targets.clear()
        self._owners.close()
        with _TABLES:
            for key in [key for key in _EXPORTED if key[0] == self.name]:
                del _EXPORTED[key]
        self._owned.clear()


def _skipped(write: _InFlight) -> int:
    """How many programs of the write's bounded copies stored nothing (its event is done, so the page-locked count
    is final); its counter slot is given back."""
    return 0 if write.counter is None else write.counter[0].give_back(write.counter[1])


def _late(write: _InFlight, skipped: int, program_bytes: int) -> str:
    """ "" if every program of the write's bounded copies stored; `LEASE_EXPIRED` if none did and the deadline was
    the lease's (the device reached the write only after it, so no byte moved, as for a write refused at its post:
    it may wait for a renewed lease); else `LATE_ON_DEVICE` (some bytes may have landed)."""
    if not skipped:
        return ""
    if skipped == write.programs and write.lease_bound:
        return LEASE_EXPIRED
    return f"{LATE_ON_DEVICE} ({skipped} blocks of {program_bytes} bytes not written)"


def _decode_ref(descriptor: RegionDescriptor) -> _IpcRef:
    try:
        ref = msgspec.msgpack.decode(descriptor.payload, type=_IpcRef)
    except msgspec.DecodeError as err:
        raise TransportError(f"malformed cuda_ipc descriptor from {descriptor.owner!r}: {err}") from err
    if len(ref.handle) != IPC_HANDLE_BYTES or ref.pid <= 0 or ref.size < descriptor.nbytes or len(ref.gpu) > 64:
        raise TransportError(
            f"cuda_ipc descriptor from {descriptor.owner!r} is out of bounds (handle {len(ref.handle)} bytes, pid "
            f"{ref.pid}, allocation {ref.size} bytes for a region of {descriptor.nbytes})"
        )
    return ref


def _device_of(gpu: str) -> torch.device:
    """This process's device whose UUID is `gpu`."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == gpu:
            return torch.device("cuda", index)
    raise TransportError(f"GPU {gpu} of the peer's region is not visible to this process (CUDA_VISIBLE_DEVICES?)")
