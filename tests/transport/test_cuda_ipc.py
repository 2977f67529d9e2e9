"""The cuda_ipc backend: GPU-to-GPU writes through CUDA IPC handles between real processes, bit-exact, with the
bounds checks, the error-to-Completion rules and the event ordering of the other backends. Host backends keep
staging on the host and refuse GPU memory (these run on the CPU too)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from kvstage.errors import TransportError, TransportUnavailable
from kvstage.transport.data import (
    RegionDescriptor,
    TransportConfig,
    create_transport,
    decode_descriptor,
    encode_descriptor,
)
from kvstage.transport.data.base import LEASE_EXPIRED
from kvstage.transport.data.loopback import wait_for

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
IPC = TransportConfig(backend="cuda_ipc")
NBYTES = 1 << 20


def _reader_main(conn: Connection, nbytes: int, backend: str) -> None:
    """Child process: a reader (cuda_ipc, or another backend with GPU memory) with one GPU region; answers "read"
    with its bytes until "exit"."""
    transport = create_transport(TransportConfig(backend=backend))
    region = transport.allocate(nbytes, device="cuda")
    conn.send(encode_descriptor(transport.export(region)))
    while conn.recv() == "read":
        conn.send(region.tensor.cpu().numpy().tobytes())
    transport.close()


@contextmanager
def reader_process(
    nbytes: int = NBYTES, backend: str = "cuda_ipc"
) -> Iterator[tuple[RegionDescriptor, Connection, mp.process.BaseProcess]]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_reader_main, args=(child, nbytes, backend), daemon=True)
    process.start()
    child.close()
    assert conn.poll(120), "reader process did not start"
    try:
        yield decode_descriptor(conn.recv()), conn, process
    finally:
        if process.is_alive():
            conn.send("exit")
            process.join(30)
        if process.is_alive():
            process.kill()


def read_back(conn: Connection) -> torch.Tensor:
    conn.send("read")
    return torch.frombuffer(bytearray(conn.recv()), dtype=torch.uint8)


def slow_fill(tensor: torch.Tensor, value: int) -> torch.cuda.Event:
    """A slow "gather": `tensor` filled with `value` on another stream after about 0.1 s of GPU sleep; the event
    completes once it is."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        tensor.fill_(value)
        filled = torch.cuda.Event()
        filled.record(side)
    return filled


@pytest.mark.gpu
@needs_cuda
def test_writes_from_another_process_land_bit_exact_in_gpu_memory() -> None:
    source = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    slices = [(0, 4096, 100), (1000, 200_000, 65_536), (300_000, 600_000, 333_333), (5, 0, 1)]
    expected = torch.zeros(NBYTES, dtype=torch.uint8)
    for s_off, d_off, n in slices:
        expected[d_off : d_off + n] = source[s_off : s_off + n]
    expected[NBYTES - 4096 :] = source[:4096]
    with reader_process() as (descriptor, conn, _), create_transport(IPC) as writer:
        src = writer.register(source.cuda())
        remote = writer.import_remote(descriptor)
        ids = [writer.write_batch(src, remote, slices), writer.write(src, 0, remote, NBYTES - 4096, 4096)]
        done = wait_for(writer, ids)
        assert all(c.ok for c in done.values()), done
        assert [done[i].ops for i in ids] == [len(slices), 1] and writer.ops_issued == len(slices) + 1
        assert torch.equal(read_back(conn), expected)


@pytest.mark.gpu
@needs_cuda
def test_a_write_outside_either_region_or_through_a_forgotten_handle_fails_before_any_byte_moves() -> None:
    with create_transport(IPC) as reader, create_transport(IPC) as writer:
        region = reader.allocate(4096, device="cuda")
        remote = writer.import_remote(reader.export(region))  # same process: found in the export table
        src = writer.register(torch.full((8192,), 7, dtype=torch.uint8, device="cuda"))
        outside = [writer.write(src, 0, remote, 4000, 200), writer.write(src, 8000, remote, 0, 500)]
        writer.forget_remote(remote)
        forgotten = writer.write(src, 0, remote, 0, 16)
        done = wait_for(writer, [*outside, forgotten])
        assert not any(c.ok for c in done.values())
        assert "outside remote region" in done[outside[0]].reason and "outside the local" in done[outside[1]].reason
        assert "not imported" in done[forgotten].reason
        assert not region.tensor.any() and writer.ops_issued == 0


@pytest.mark.gpu
@needs_cuda
def test_a_descriptor_claiming_more_than_its_allocation_is_refused_at_import() -> None:
    with reader_process(4096) as (descriptor, _, _), create_transport(IPC) as writer:
        payload = msgspec.msgpack.decode(descriptor.payload)
        payload["size"] = 1 << 30  # the claimed allocation, and the region, far beyond the real 4096 bytes
        forged = msgspec.structs.replace(descriptor, nbytes=1 << 30, payload=msgspec.msgpack.encode(payload))
        with pytest.raises(TransportError, match="claims"):
            writer.import_remote(forged)
        payload = msgspec.msgpack.decode(descriptor.payload)
        payload["handle"] = b"not a handle"
        with pytest.raises(TransportError, match="out of bounds"):
            writer.import_remote(msgspec.structs.replace(descriptor, payload=msgspec.msgpack.encode(payload)))


@pytest.mark.gpu
@needs_cuda
def test_a_write_to_a_reader_whose_process_exited_fails_as_peer_gone() -> None:
    with reader_process() as (descriptor, conn, process), create_transport(IPC) as writer:
        remote = writer.import_remote(descriptor)
        src = writer.register(torch.ones(64, dtype=torch.uint8, device="cuda"))
        conn.send("exit")
        process.join(30)
        late = writer.write(src, 0, remote, 0, 64)
        [completion] = wait_for(writer, [late]).values()
        assert not completion.ok and completion.peer_gone and "peer dead" in completion.reason


@pytest.mark.gpu
@needs_cuda
def test_a_write_starts_after_the_event_it_is_ordered_after_and_not_after_its_lease() -> None:
    with create_transport(IPC) as reader, create_transport(IPC) as writer:
        region = reader.allocate(NBYTES, device="cuda")
        remote = writer.import_remote(reader.export(region))
        source = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
        src = writer.register(source)
        gathered = slow_fill(source, 9)
        write = writer.write_batch(src, remote, [(0, 0, NBYTES)], gathered)
        assert wait_for(writer, [write])[write].ok
        assert gathered.query() and bool((region.tensor == 9).all())

        expired = writer.write_batch(src, remote, [(0, 0, 16)], not_after=time.monotonic() - 1.0)
        [completion] = wait_for(writer, [expired]).values()
        assert not completion.ok and completion.reason == LEASE_EXPIRED


def test_host_backends_keep_staging_on_the_host_and_refuse_gpu_memory(tmp_path) -> None:
    with create_transport(TransportConfig(shm_dir=str(tmp_path))) as local:
        assert local.staging_device(torch.device("cuda", 0)) == torch.device("cpu")
        assert local.staging_device(torch.device("cpu")) == torch.device("cpu")
        with pytest.raises(TransportError, match="host memory only"):
            local.allocate(64, device="cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_ipc_without_a_gpu_is_unavailable_and_says_why() -> None:
    with pytest.raises(TransportUnavailable, match="needs a CUDA GPU"):
        create_transport(IPC)
