"""Two-process loopback harness for the data transports: a reader peer process and a raw-bandwidth measurement.

Owns: `ReaderPeer`, a child process (spawned, never forked) that builds a transport, allocates one region, hands
its descriptor to the parent and then answers the parent's commands (digest or read a byte range, close the
transport, exit); `wait_for`, which polls a transport until given transfers complete; `best_write_time`, which
times writes from submission to last completion; and `measure_raw_bulk`, which times one bulk write against the
same bytes written as many small slices, between two processes.

Invariants: the child talks to the parent only over its private multiprocessing pipe (trusted, same user); a
child that fails to start reports the error instead of leaving the parent waiting; every wait has a timeout; a
child dies with its parent (`die_with_parent`, also used by the multi-process tests' workers), so a killed run
leaves no process behind. Called by tests/transport/test_data_*.py, benchmarks/raw_bulk.py and `kvstage bench`
(its raw path).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvstage.errors import KVStageError, TransportError
from kvstage.transport.data import create_transport
from kvstage.transport.data.base import (
    Completion,
    DataTransport,
    LocalRegion,
    RegionDescriptor,
    RemoteRegion,
    Slice,
    TransportConfig,
    decode_descriptor,
    encode_descriptor,
)


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a uint8 tensor's bytes: how both sides compare what landed."""
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


#: prctl(2) option: the signal the kernel sends this process when its parent exits.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (`parent`, its pid as the parent saw it) exits; if the
    parent is already gone, exit now. Linux only; elsewhere a no-op (the pipe to the parent still ends the child
    once the parent is gone and the child next reads it)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)  # the parent died before we asked to follow it


def _reader_main(conn: Connection, config: TransportConfig, nbytes: int, parent: int, caller_memory: bool) -> None:
    """Child process body: own a transport and one region, answer commands until told to exit."""
    die_with_parent(parent)
    try:
        transport = create_transport(config)
        memory = torch.zeros(nbytes, dtype=torch.uint8) if caller_memory else None
        region = transport.allocate(nbytes) if memory is None else transport.register(memory)
        conn.send(("ok", encode_descriptor(transport.export(region))))
    except (KVStageError, OSError) as err:  # a start-up failure goes back to the parent, then we exit
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    while True:
        command, *args = conn.recv()
        if command == "digest":
            offset, length = args
            conn.send(digest(region.tensor[offset : offset + length]))
        elif command == "read":
            offset, length = args
            conn.send(region.tensor[offset : offset + length].numpy().tobytes())
        elif command == "close":
            transport.close()
            conn.send("closed")
        else:
            transport.close()
            conn.send("bye")
            return


class ReaderPeer:
    """A reader in its own process: `descriptor` describes its region of `nbytes` (zeroed at start)."""

    def __init__(
        self, config: TransportConfig, nbytes: int, start_timeout_s: float = 60.0, *, caller_memory: bool = False
    ) -> None:
        """With `caller_memory`, the region is memory the reader allocated itself and registered (as an engine's
        KV cache is), not the transport's `allocate`."""
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        args = (child_conn, config, nbytes, os.getpid(), caller_memory)
        self.process = ctx.Process(target=_reader_main, args=args, daemon=True)
        self.process.start()
        child_conn.close()
        status, payload = self._recv(start_timeout_s)
        if status != "ok":
            self.process.join(5.0)
            raise TransportError(f"reader peer failed to start: {payload}")
        self.descriptor: RegionDescriptor = decode_descriptor(payload)

    def digest(self, offset: int, length: int) -> str:
        return str(self._ask(("digest", offset, length)))

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._ask(("read", offset, length)))

    def close_transport(self) -> None:
        """Close the peer's transport but keep its process alive (a peer that left)."""
        self._ask(("close",))

    def kill(self) -> None:
        """SIGKILL the peer process and reap it."""
        self.process.kill()
        self.process.join(10.0)

    def stop(self) -> None:
        """Ask the peer to close and exit; kill it if it does not."""
        if self.process.is_alive():
            self._conn.send(("exit",))
            if self._conn.poll(30.0):
                self._conn.recv()
            self.process.join(10.0)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> ReaderPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ask(self, command: tuple[Any, ...], timeout_s: float = 60.0) -> Any:
        self._conn.send(command)
        return self._recv(timeout_s)

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TransportError(f"reader peer process {self.process.pid} did not answer within {timeout_s} s")
        try:
            return self._conn.recv()
        except EOFError as err:
            raise TransportError(f"reader peer process {self.process.pid} exited without answering") from err


def wait_for(transport: DataTransport, transfer_ids: Iterable[int], timeout_s: float = 60.0) -> dict[int, Completion]:
    """Poll until every id in `transfer_ids` has completed; raises `TransportError` on timeout."""
    waiting = set(transfer_ids)
    done: dict[int, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while waiting:
        for completion in transport.poll():
            done[completion.transfer_id] = completion
            waiting.discard(completion.transfer_id)
        if waiting:
            if time.monotonic() > deadline:
                raise TransportError(f"{len(waiting)} transfers still in flight after {timeout_s} s")
            time.sleep(0.0002)
    return done


@dataclass(frozen=True, slots=True)
class RawBulkResult:
    """Loopback throughput of one bulk write versus the same bytes as `slice_ops` writes of `slice_bytes`."""

    backend: str
    nbytes: int
    slice_bytes: int
    bulk_gbps: float
    slice_gbps: float
    bulk_ops: int
    slice_ops: int

    @property
    def bulk_over_slice(self) -> float:
        return self.bulk_gbps / self.slice_gbps


def scattered_slices(nbytes: int, slice_bytes: int) -> list[Slice]:
    """`nbytes // slice_bytes` slices whose source and destination blocks are both permuted (no two neighbours
    adjacent), as the per-slice path's (layer, K/V, page, head range) pieces are; no backend can merge them."""
    count = nbytes // slice_bytes
    src_stride, dst_stride = _coprime_stride(count, 7), _coprime_stride(count, 13)
    return [
        ((i * src_stride) % count * slice_bytes, (i * dst_stride) % count * slice_bytes, slice_bytes)
        for i in range(count)
    ]


def _coprime_stride(count: int, start: int) -> int:
    stride = start
    while count > 1 and _gcd(stride, count) != 1:
        stride += 1
    return stride


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def measure_raw_bulk(
    config: TransportConfig,
    nbytes: int,
    slice_bytes: int,
    *,
    repeats: int = 3,
    batch_slices: int = 4096,
    timeout_s: float = 120.0,
) -> RawBulkResult:
    """Best-of-`repeats` GB/s of a bulk write and of per-slice writes of `nbytes` into a reader process.

    `config` is used for both sides (each gets a fresh name). Per-slice writes go out in batches of at most
    `batch_slices` slices, all submitted before waiting, so the backend can overlap them.
    """
    if nbytes % slice_bytes:
        raise ValueError(f"nbytes {nbytes} is not a multiple of slice_bytes {slice_bytes}")
    reader_config = replace(config, name=TransportConfig().name)
    writer_config = replace(config, name=TransportConfig().name)
    with ReaderPeer(reader_config, nbytes) as peer, create_transport(writer_config) as writer:
        source = writer.allocate(nbytes)
        source.tensor.copy_(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        )
        remote = writer.import_remote(peer.descriptor)
        slices = scattered_slices(nbytes, slice_bytes)
        bulk_s = best_write_time(writer, repeats, timeout_s, lambda: [writer.write(source, 0, remote, 0, nbytes)])
        bulk_ops = writer.ops_issued
        if peer.digest(0, nbytes) != digest(source.tensor):
            raise TransportError(f"{config.backend}: bulk write did not land bit-exact")
        batches = [slices[i : i + batch_slices] for i in range(0, len(slices), batch_slices)]
        slice_s = best_write_time(writer, repeats, timeout_s, lambda: _submit_batches(writer, source, remote, batches))
        slice_ops = (writer.ops_issued - bulk_ops) // repeats
    return RawBulkResult(
        config.backend,
        nbytes,
        slice_bytes,
        nbytes / bulk_s / 1e9,
        nbytes / slice_s / 1e9,
        bulk_ops // repeats,
        slice_ops,
    )


def _submit_batches(
    writer: DataTransport, source: LocalRegion, remote: RemoteRegion, batches: list[list[Slice]]
) -> list[int]:
    return [writer.write_batch(source, remote, batch) for batch in batches]


def best_write_time(
    writer: DataTransport, repeats: int, timeout_s: float, submit: Callable[[], Iterable[int]]
) -> float:
    """Shortest wall time, over `repeats` runs, of `submit()` (which starts writes and returns their transfer ids)
    until the last of them completes; any failed completion raises `TransportError`."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        completions = wait_for(writer, submit(), timeout_s)
        elapsed = time.perf_counter() - start
        failed = [c for c in completions.values() if not c.ok]
        if failed:
            raise TransportError(f"loopback write failed: {failed[0].reason}")
        best = min(best, elapsed)
    return best
