"""Writes into another process's memory on this host: Linux cross-memory attach (`process_vm_writev`).

Owns `ProcessMemory` (a peer process's exported range: its pid, its start time, the range's address and size),
`this_process` (this process's identity, for a descriptor) and `write_runs` (a batch of (source address,
destination offset, length) runs in as few system calls as the kernel allows: up to `IOV_MAX` runs a call, one
prepared iovec list per call, no copy through a buffer). The `local` backend uses it to write into memory it did
not allocate, such as an engine's own KV cache (transport/data/local.py).

Invariants: a write goes only to the process that exported the range, never to a later process that reuses its pid
(`gone` compares the start time the descriptor names, before every batch); every run lies inside the exported
range (checked by the transport's precheck against the descriptor's size, and again here); a short or failed
system call fails the whole write with the kernel's reason, nothing is retried. Linux only; the kernel's ptrace
rules apply (same user, and `kernel.yama.ptrace_scope` at most 0 or the capability to trace): where they deny it,
the first write fails with EPERM and says so.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Runs per `process_vm_writev` call (the kernel's `UIO_MAXIOV`).
IOV_MAX = 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.process_vm_writev
_writev.restype = ctypes.c_ssize_t
_writev.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (`/proc/PID/stat`, field 22), or None if it has
    exited or is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields from the 3rd on: state is fields[0]
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """`nbytes` bytes at `address` in process `pid`, which started at `started` (clock ticks since boot)."""

    pid: int
    started: int
    address: int
    nbytes: int

    def gone(self) -> str:
        """Why this range can no longer be written (its process exited, or the pid is another process's), or ""."""
        now = start_time(self.pid)
        if now is None:
            return f"peer dead: process {self.pid} has exited"
        if now != self.started:
            return f"peer dead: process {self.pid} has exited (its pid now names another process)"
        return ""


def this_process(address: int, nbytes: int) -> ProcessMemory:
    """`[address, address + nbytes)` of this process, as a writer elsewhere on the host reaches it."""
    pid = os.getpid()
    started = start_time(pid)
    if started is None:
        raise OSError("cannot read this process's start time from /proc; cross-memory writes need procfs")
    return ProcessMemory(pid, started, address, nbytes)


def write_runs(target: ProcessMemory, source: int, runs: Sequence[tuple[int, int, int]]) -> str:
    """Copy each run `(source offset, destination offset, length)` from this process's memory at `source` into
    `target`; returns "" or why it failed. `IOV_MAX` runs go in one system call, local and remote iovecs side by
    side."""
    for offset, dst, length in runs:
        if dst < 0 or length < 0 or dst + length > target.nbytes or offset < 0:
            return f"run [{dst}, {dst + length}) is outside the peer's {target.nbytes} bytes"
    for first in range(0, len(runs), IOV_MAX):
        batch = runs[first : first + IOV_MAX]
        local = (_IoVec * len(batch))(*(_IoVec(source + offset, length) for offset, _, length in batch))
        remote = (_IoVec * len(batch))(*(_IoVec(target.address + dst, length) for _, dst, length in batch))
        want = sum(length for _, _, length in batch)
        done = _writev(target.pid, local, len(batch), remote, len(batch), 0)
        if done != want:
            err = ctypes.get_errno()
            why = os.strerror(err) if done < 0 else f"{done} of {want} bytes written"
            if done < 0 and err == errno.EPERM:
                why += " (the kernel's ptrace rules: same user, kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE)"
            return f"process_vm_writev into process {target.pid} failed: {why}"
    return ""
