"""The `local` data backend: same-host shared memory, the embedded default with no extra dependency.

Owns: the shared-memory segments behind regions from `allocate` (files under `TransportConfig.shm_dir`, named
`kvstage-<pid>-<tag>-<region>`), the writer-side mappings of peers' segments, and the completions of the writes it
has carried out that `poll` has not returned yet.

How it works. `allocate` creates a segment file, reserves all its pages at once (`posix_fallocate`: a
shared-memory filesystem too small for it fails `allocate` with a `TransportError` naming the directory, the size
and the free space, rather than a later write dying of SIGBUS), maps it and hands out a tensor over the mapping;
its descriptor names the segment and the owner's pid. A writer maps the named segment and a write is a `copy_` into
that mapping, done inside `write` on the caller's thread (the agent's reactor: a chunk's write then costs no hand-off
to another thread, and torch copies with the GIL released); `poll` reports it.

Caller memory (a `KVPool`, or an engine's own KV cache) is exported as this process's memory instead: its pid,
its start time and the address (`_ProcessRef`), and a writer copies into it with cross-memory writes,
`process_vm_writev`, up to 1024 runs a system call (cma.py), the same way.

Ownership. The process that created a segment is the only one that unlinks it (on `unregister` or `close`);
writers only map and unmap. We do not use `multiprocessing.shared_memory`, whose resource tracker would unlink a
segment when any process that merely attached to it exits. A segment left behind by a process killed with
SIGKILL is swept by the next `LocalTransport` started by the same user.

Invariants: a write to a peer whose process has died (or whose pid now names another process), or that has released
the segment, fails with a reason and `peer_gone` before any byte is copied; a write whose `not_after` has passed
right before its first byte would be copied copies nothing (`LEASE_EXPIRED`); with `max_write_s`, the copy goes in
pieces and stops between two once half of `max_write_s` has passed since it began; a failed copy becomes a failed
completion, never an exception out of `write`.
Called through `kvstage.transport.data.create_transport`.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import select
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import torch
from msgspec import Meta

from kvstage.errors import TransportError
from kvstage.transport.data import cma
from kvstage.transport.data.base import (
    Completion,
    DataTransport,
    LocalRegion,
    RegionDescriptor,
    RemoteRegion,
    Slice,
    TransportConfig,
    WriteBound,
)
from kvstage.transport.data.cma import ProcessMemory

log = logging.getLogger(__name__)

_SEGMENT_RE = re.compile(r"kvstage-(\d+)-[0-9a-f]{12}-\d+")


class _SegmentRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="segment"):
    """Payload of a local descriptor of an `allocate`d region: the segment's file name (no directory) and its owner's
    pid."""

    segment: str
    pid: int


class _ProcessRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="process"):
    """Payload of a local descriptor of caller memory (an engine's KV cache): its owner's pid and start time, and
    the memory's address there; writers reach it with cross-memory writes (cma.py)."""

    pid: Annotated[int, Meta(ge=1, le=2**31)]
    started: Annotated[int, Meta(ge=0)]
    address: Annotated[int, Meta(ge=1, le=2**63 - 1)]  # a user-space address (x86-64, arm64: below 2**48)


@dataclass(frozen=True, slots=True)
class _Segment:
    """A mapped segment file: a tensor over its mapping, its owner's pid and its inode (to detect a release)."""

    path: Path
    tensor: torch.Tensor
    pid: int
    inode: int


@dataclass(frozen=True, slots=True)
class _Job:
    transfer_id: int
    src: torch.Tensor
    dst: _Segment | ProcessMemory
    slices: tuple[Slice, ...]
    bound: WriteBound

    @property
    def ops(self) -> int:
        return len(self.slices)


class LocalTransport(DataTransport):
    """Shared-memory backend: peers must be on the same host and see the same `shm_dir`."""

    backend = "local"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._dir = Path(config.shm_dir)
        if not self._dir.is_dir():
            raise TransportError(f"shared-memory directory {self._dir} does not exist; set TransportConfig.shm_dir")
        self._tag = uuid.uuid4().hex[:12]
        self._owned: dict[int, _Segment] = {}
        self._mapped: dict[int, _Segment | ProcessMemory] = {}
        _sweep_dead_segments(self._dir)
        self._done: list[Completion] = []
        self._owners = ProcessWatch()  # is each segment's owner alive (asked before every write)

    # ---- memory -------------------------------------------------------------------------------------------
    def _allocate(self, nbytes: int, region_id: int, pinned: bool) -> torch.Tensor:  # shared memory: never pinned
        path = self._dir / f"kvstage-{os.getpid()}-{self._tag}-{region_id}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve(fd, nbytes, self._dir)
            segment = _Segment(path, _map(fd, nbytes), os.getpid(), os.fstat(fd).st_ino)
        except (OSError, TransportError):
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._owned[region_id] = segment
        return segment.tensor

    def _register(self, region: LocalRegion) -> None:
        """Any CPU tensor can be a write source, and exported: an `allocate`d one as its segment, caller memory
        (an engine's KV cache) as this process's memory, which writers reach with cross-memory writes."""

    def _unregister(self, region: LocalRegion) -> None:
        segment = self._owned.pop(region.region_id, None)
        if segment is not None:
            segment.path.unlink(missing_ok=True)

    def _export_payload(self, region: LocalRegion) -> bytes:
        segment = self._owned.get(region.region_id)
        if segment is not None:
            return msgspec.msgpack.encode(_SegmentRef(segment.path.name, segment.pid))
        try:
            memory = cma.this_process(region.address, region.nbytes)
        except OSError as err:
            raise TransportError(f"the local backend cannot export caller memory here: {err}") from err
        return msgspec.msgpack.encode(_ProcessRef(memory.pid, memory.started, memory.address))

    def _import(self, descriptor: RegionDescriptor, remote: RemoteRegion) -> None:
        try:
            ref = msgspec.msgpack.decode(descriptor.payload, type=_SegmentRef | _ProcessRef)
        except msgspec.DecodeError as err:
            raise TransportError(f"malformed local descriptor from {descriptor.owner!r}: {err}") from err
        if isinstance(ref, _ProcessRef):
            self._mapped[remote.key] = ProcessMemory(ref.pid, ref.started, ref.address, descriptor.nbytes)
            return
        if _SEGMENT_RE.fullmatch(ref.segment) is None:
            raise TransportError(f"descriptor from {descriptor.owner!r} names an invalid segment {ref.segment!r}")
        path = self._dir / ref.segment
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as err:
            raise TransportError(f"cannot open segment {ref.segment} of {descriptor.owner!r}: {err}") from err
        try:
            stat = os.fstat(fd)
            if stat.st_size < descriptor.nbytes:
                raise TransportError(
                    f"segment {ref.segment} has {stat.st_size} bytes, descriptor says {descriptor.nbytes}"
                )
            self._mapped[remote.key] = _Segment(path, _map(fd, descriptor.nbytes), ref.pid, stat.st_ino)
            self._owners.watch(ref.pid)
        finally:
            os.close(fd)

    def _forget(self, remote: RemoteRegion) -> None:
        mapped = self._mapped.pop(remote.key, None)
        if isinstance(mapped, _Segment):
            self._owners.release(mapped.pid)

    # ---- writes --------------------------------------------------------------------------------------------
    def _submit(
        self, transfer_id: int, src: LocalRegion, dst: RemoteRegion, slices: Sequence[Slice], bound: WriteBound
    ) -> str:
        self._done.append(self._move(_Job(transfer_id, src.tensor, self._mapped[dst.key], tuple(slices), bound)))
        self._completed()
        return ""

    def _move(self, job: _Job) -> Completion:
        """Carry the write out now: the peer and the bound are checked right before the first byte (`_run_job`)."""
        return _run_job(job, self._owners)

    def _progress(self) -> list[Completion]:
        done, self._done = self._done, []
        return done

    def _close(self) -> None:
        for segment in self._owned.values():
            segment.path.unlink(missing_ok=True)
        self._owned.clear()
        self._mapped.clear()
        self._owners.close()


def _run_job(job: _Job, owners: ProcessWatch) -> Completion:
    """Copy every slice of `job`, piece by piece as its bound allows; any error fails the whole transfer."""
    reason = _peer_gone(job.dst, owners)
    if reason:
        return Completion(job.transfer_id, False, reason, len(job.slices), peer_gone=True)
    reason = job.bound.move(job.slices, lambda piece, _: _copy(job, piece))
    if reason and isinstance(job.dst, ProcessMemory) and job.dst.gone():
        return Completion(job.transfer_id, False, job.dst.gone(), len(job.slices), peer_gone=True)
    return Completion(job.transfer_id, not reason, reason, len(job.slices))


def _copy(job: _Job, piece: tuple[Slice, ...]) -> str:
    if isinstance(job.dst, ProcessMemory):  # one system call per IOV_MAX slices, checked against its pid first
        return job.dst.gone() or cma.write_runs(job.dst, job.src.data_ptr(), piece)
    try:
        for s_off, d_off, length in piece:
            job.dst.tensor[d_off : d_off + length].copy_(job.src[s_off : s_off + length])
    except (RuntimeError, OSError) as err:
        log.warning("local write %d into %s failed: %s", job.transfer_id, job.dst.path.name, err)
        return f"copy into {job.dst.path.name} failed: {err}"
    return ""


def _peer_gone(segment: _Segment | ProcessMemory, owners: ProcessWatch) -> str:
    """Reason the segment's owner (or the process memory's) can no longer receive writes (dead or released), or
    ""."""
    if isinstance(segment, ProcessMemory):
        return segment.gone()
    if not owners.alive(segment.pid):
        return f"peer dead: owner process {segment.pid} of segment {segment.path.name} has exited"
    try:
        released = os.stat(segment.path).st_ino != segment.inode
    except FileNotFoundError:
        released = True
    return f"peer closed: segment {segment.path.name} was released by its owner" if released else ""


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path(f"/proc/{pid}/stat")
    if not Path("/proc/self/stat").exists():
        return True  # no procfs: the kill above is all we can know
    try:
        stat = proc.read_text()
    except FileNotFoundError:
        return False  # it ended between the kill and the read
    except OSError as err:
        log.debug("cannot read %s (%s); taking process %d as alive", proc, err, pid)
        return True
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


class ProcessWatch:
    """Whether the owners of imported regions still run, asked before every write: through each pid's pidfd, which
    becomes readable once the process has ended (zombies included), so an ask is one `poll` where `pid_alive`
    reads /proc (tens of microseconds a write, on the reactor). `poll`, not `select`: a busy engine process may hold
    descriptors past `select`'s 1024. `pid_alive` serves a pid whose pidfd cannot be opened (no pidfd support, no
    permission). A transport `watch`es the owner of each region it imports and `release`s it when it forgets the
    region; a pid's descriptor is closed with its last region (or at `close`)."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[int, select.poll] | bool] = {}  # pid -> (pidfd, its poller), or True (ask
        # /proc) or False (gone when first asked)
        self._regions: Counter[int] = Counter()

    def watch(self, pid: int) -> None:
        self._regions[pid] += 1

    def release(self, pid: int) -> None:
        self._regions[pid] -= 1
        if self._regions[pid] <= 0:
            del self._regions[pid]
            self._close(pid)

    def alive(self, pid: int) -> bool:
        watched = self._watched.get(pid)
        if watched is None:
            watched = self._watched[pid] = self._open(pid)
        if isinstance(watched, bool):
            return watched and pid_alive(pid)
        return not watched[1].poll(0)

    def close(self) -> None:
        for pid in list(self._watched):
            self._close(pid)
        self._regions.clear()

    def _close(self, pid: int) -> None:
        watched = self._watched.pop(pid, False)
        if not isinstance(watched, bool):
            os.close(watched[0])

    def _open(self, pid: int) -> tuple[int, select.poll] | bool:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError as err:  # no pidfd here (ENOSYS), or not ours to watch (EPERM): /proc it is
            log.debug("no pidfd for process %d (%s); asking /proc instead", pid, err)
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return fd, poller


def _reserve(fd: int, nbytes: int, directory: Path) -> None:
    """Size the segment file to `nbytes` with every page backed now, not on first touch.

    A sparse file (ftruncate alone) would let `allocate` succeed on a tmpfs too small for it, and the first write
    past what the tmpfs can hold would kill the writing process with SIGBUS. `posix_fallocate` makes the tmpfs find
    the pages at once, so a shortage is a `TransportError` here instead."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        try:
            stat = os.statvfs(directory)
            free = f"{stat.f_bavail * stat.f_frsize} bytes free"
        except OSError as stat_err:
            free = f"free space unknown ({stat_err})"
        raise TransportError(
            f"cannot reserve {nbytes} bytes of shared memory in {directory} ({free}): {err}; "
            "give the shared-memory filesystem more room (e.g. docker --shm-size) or set TransportConfig.shm_dir"
        ) from err


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """Tensor over a shared read-write mapping of the first `nbytes` of `fd`; the tensor keeps the mapping alive.

    The mapping is unmapped when the last tensor over it is garbage-collected, never explicitly, so a copy still
    running on the copy thread cannot touch unmapped memory."""
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


def _sweep_dead_segments(directory: Path) -> None:
    """Unlink segments this user's processes left behind when they died without closing (e.g. SIGKILL)."""
    uid = os.getuid()
    for path in directory.glob("kvstage-*"):
        match = _SEGMENT_RE.fullmatch(path.name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            if path.stat().st_uid == uid:
                path.unlink()
                log.info("removed shared-memory segment %s left by dead process %s", path.name, match.group(1))
        except FileNotFoundError:
            log.debug("segment %s was already removed by another sweeper", path.name)
