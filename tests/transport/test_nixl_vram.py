"""The nixl backend on GPU memory: regions registered as NIXL "VRAM", so UCX moves them with its CUDA transports
(cuda_ipc between processes of one host). A write from a GPU (or host) source lands bit-exact in another
process's GPU region; the agents' staging goes on the KV's GPU. Needs a GPU and a NIXL build for the host's CUDA
(docs/gpu.md); skips otherwise."""

from __future__ import annotations

import pytest
import torch
from test_cuda_ipc import NBYTES, read_back, reader_process, slow_fill

from kvstage.errors import TransportUnavailable
from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.loopback import wait_for
from kvstage.transport.data.nixl import load_nixl


def _nixl_missing() -> str:
    try:
        load_nixl()
    except TransportUnavailable as err:
        return str(err)
    return ""


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(bool(_nixl_missing()), reason=f"needs NIXL: {_nixl_missing()}"),
]


def _nixl() -> TransportConfig:
    """A nixl config with a fresh agent name (NIXL refuses to load a peer of its own name)."""
    return TransportConfig(backend="nixl", write_timeout_s=30.0)


def _expected(source: torch.Tensor, slices: list[tuple[int, int, int]]) -> torch.Tensor:
    expected = torch.zeros(NBYTES, dtype=torch.uint8)
    for s_off, d_off, n in slices:
        expected[d_off : d_off + n] = source[s_off : s_off + n]
    return expected


@pytest.mark.parametrize("source_on", ["cuda", "cpu"])
def test_a_write_into_another_processs_gpu_region_lands_bit_exact(source_on: str) -> None:
    source = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    slices = [(0, 4096, 100), (1000, 200_000, 65_536), (300_000, 600_000, 333_333), (5, 0, 1), (0, NBYTES - 4096, 4096)]
    with reader_process(backend="nixl") as (descriptor, conn, _), create_transport(_nixl()) as writer:
        assert writer.staging_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
        src = writer.register(source.to(source_on))
        remote = writer.import_remote(descriptor)
        ids = [writer.write_batch(src, remote, slices[:4]), writer.write(src, 0, remote, NBYTES - 4096, 4096)]
        done = wait_for(writer, ids)
        assert all(c.ok for c in done.values()), done
        assert writer.ops_issued == len(slices)
        assert torch.equal(read_back(conn), _expected(source, slices))


def test_a_gpu_write_starts_after_its_event_and_outside_the_region_fails_before_any_byte_moves() -> None:
    with create_transport(_nixl()) as reader, create_transport(_nixl()) as writer:
        region = reader.allocate(NBYTES, device="cuda")
        assert region.tensor.is_cuda
        remote = writer.import_remote(reader.export(region))
        source = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
        src = writer.register(source)
        write = writer.write_batch(src, remote, [(0, 0, NBYTES)], slow_fill(source, 9))
        outside = writer.write(src, 0, remote, NBYTES - 10, 100)
        done = wait_for(writer, [write, outside])
        assert done[write].ok, done[write]
        assert not done[outside].ok and "outside remote region" in done[outside].reason
        assert bool((region.tensor == 9).all())
