"""Agents with their KV and their staging on a GPU, over the cuda_ipc backend (and nixl, VRAM through UCX): rooms
hand off bit-exact, and ring space and a failed room's pages go back only once the scatters that read or wrote them
have landed (their CUDA events), with no stream or device synchronize on the way."""

from __future__ import annotations

import time

import pytest
import torch
from agent_outcomes import wait_outcomes

from kvstage.dataplane import KVPool
from kvstage.errors import TransportUnavailable
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.data import TransportConfig
from kvstage.transport.data.nixl import load_nixl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", page_size=16)
TIMING = Timing(heartbeat_s=0.2, dead_after_s=10.0, retry_initial_s=0.02, retry_max_s=0.2)
CHUNK, RING = 64, 1 << 22
#: GPU cycles that keep a copy thread's stream busy (about 3 s at the H200's 1.98 GHz)
HOLD_CYCLES = 6_000_000_000


@pytest.fixture
def cluster():
    made: list[tuple[BootstrapServer, list]] = []

    def make(
        prefill_tp: int, decode_tp: int, backend: str = "cuda_ipc"
    ) -> tuple[list[PrefillAgent], list[DecodeAgent]]:
        bootstrap = BootstrapServer().start()

        def config(instance: str, tp: int, rank: int) -> AgentConfig:
            return AgentConfig(
                instance=instance, rank=rank, tp_size=tp, layout=LAYOUT, bootstrap=bootstrap.address,
                transport=TransportConfig(backend=backend), timing=TIMING, chunk_tokens=CHUNK,
                ring_bytes=RING, staging_bytes=RING,
            )  # fmt: skip

        def pool(tp: int, rank: int) -> KVPool:
            return KVPool.for_rank(LAYOUT, tp, rank, num_pages=64, device="cuda")

        decode = [DecodeAgent(config("D", decode_tp, r), pool(decode_tp, r)).start() for r in range(decode_tp)]
        prefill = [PrefillAgent(config("P", prefill_tp, r), pool(prefill_tp, r)).start() for r in range(prefill_tp)]
        made.append((bootstrap, decode + prefill))
        return prefill, decode

    yield make
    for bootstrap, agents in made:
        for agent in agents:
            agent.close()
        bootstrap.close()


def _byte_view(pool: KVPool) -> torch.Tensor:
    return pool.flat.view(2, LAYOUT.num_layers, pool.geometry.num_slots, pool.num_heads, LAYOUT.head_bytes)


def _start_room(prefill: list[PrefillAgent], decode: list[DecodeAgent], room: int, num_tokens: int) -> dict:
    """Random KV in the prefill pools, the room handed off; returns the KV and each side's pages."""
    kv = torch.randint(0, 256, (2, LAYOUT.num_layers, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_bytes))
    kv = kv.to(torch.uint8)
    npages = -(-num_tokens // LAYOUT.page_size)
    sides: dict = {"kv": kv, "decode": []}
    peers = tuple(peer_id("P", r) for r in range(len(prefill)))
    for agent in decode:
        pages = agent.pool.allocator.allocate(npages, room)
        sides["decode"].append(pages)
        agent.expect_room(room, peers, num_tokens, 0, tuple(pages), timeout_s=30)
    for rank, agent in enumerate(prefill):
        pages = agent.pool.allocator.allocate(npages, room)
        heads = heads_of_rank(LAYOUT.num_kv_heads, len(prefill), rank)
        slots = agent.pool.slot_indices(pages, 0, num_tokens)
        _byte_view(agent.pool).index_copy_(2, slots, kv[:, :, :, heads.start : heads.stop].cuda())
        agent.attach_room(room, num_tokens, len(decode), timeout_s=30)
        agent.compute_scheduled(room, num_tokens)
        agent.kv_ready(room, num_tokens, tuple(pages))
    return sides


def _landed(decode: list[DecodeAgent], sides: dict) -> bool:
    kv = sides["kv"]
    for rank, agent in enumerate(decode):
        heads = heads_of_rank(LAYOUT.num_kv_heads, len(decode), rank)
        slots = agent.pool.slot_indices(sides["decode"][rank], 0, kv.shape[2])
        if not torch.equal(_byte_view(agent.pool).index_select(2, slots).cpu(), kv[:, :, :, heads.start : heads.stop]):
            return False
    return True


def _warm_up(prefill: list[PrefillAgent], decode: list[DecodeAgent]) -> None:
    """One room end to end, so that peers are resolved and kernels compiled before a test holds a stream."""
    _start_room(prefill, decode, 100, 64)
    for agent in decode + prefill:
        assert wait_outcomes(agent, 1, timeout=60)[100].ok


def _hold_stream(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Keep `stream` busy for HOLD_CYCLES GPU cycles; the event completes when it is free again."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(HOLD_CYCLES)
        released = torch.cuda.Event()
        released.record(stream)
    return released


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "backend"), [(2, 1, "cuda_ipc"), (1, 2, "cuda_ipc"), (2, 1, "nixl")]
)
def test_kv_and_staging_on_the_gpu_hand_off_bit_exact(cluster, prefill_tp, decode_tp, backend):
    if backend == "nixl":
        try:
            load_nixl()
        except TransportUnavailable as err:
            pytest.skip(str(err))
    prefill, decode = cluster(prefill_tp, decode_tp, backend)
    assert all(a.ring_region.tensor.is_cuda for a in decode) and all(a.staging_region.tensor.is_cuda for a in prefill)
    sides = {room: _start_room(prefill, decode, room, n) for room, n in ((1, 300), (2, 64), (3, 17))}
    for agent in decode + prefill:
        outcomes = wait_outcomes(agent, len(sides), timeout=60)
        assert all(o.ok for o in outcomes.values()), outcomes
    assert all(_landed(decode, side) for side in sides.values())
    for agent in decode:
        assert agent.wait_quiescent(10) and agent.snapshot().ring_live_bytes == 0


def test_a_chunks_ring_space_is_freed_only_once_its_scatter_has_landed(cluster):
    prefill, decode = cluster(2, 1)
    [reader] = decode
    assert reader.copier.stream is not None
    _warm_up(prefill, decode)
    released = _hold_stream(reader.copier.stream)  # every scatter queues behind this
    sides = _start_room(prefill, decode, 1, 128)
    while not reader._landing:  # a scatter queued behind the held stream
        assert not released.query(), "the held stream ran out before a scatter was queued: raise HOLD_CYCLES"
        time.sleep(0.002)
    while not released.query():
        assert reader.snapshot().ring_live_bytes > 0 and not reader.poll(), "ring freed before the scatter landed"
        time.sleep(0.01)
    assert wait_outcomes(reader, 1, timeout=30)[1].ok and _landed(decode, sides)
    assert reader.wait_quiescent(10) and reader.snapshot().ring_live_bytes == 0


def test_an_abort_during_a_scatter_gives_the_pages_back_only_after_that_scatter_landed(cluster):
    prefill, decode = cluster(2, 1)
    [reader] = decode
    assert reader.copier.stream is not None
    _warm_up(prefill, decode)
    released = _hold_stream(reader.copier.stream)
    sides = _start_room(prefill, decode, 7, 128)
    while not reader._landing:  # a scatter queued behind the held stream
        assert not released.query(), "the held stream ran out before a scatter was queued: raise HOLD_CYCLES"
        time.sleep(0.002)
    reader.abort(7)
    while not released.query():
        assert not reader.poll(), "the failed room's pages went back while its scatter was still queued"
        time.sleep(0.01)
    [outcome] = wait_outcomes(reader, 1, timeout=30).values()
    assert not outcome.ok and "abort" in outcome.reason
    assert sorted(outcome.pages) == sorted(sides["decode"][0])
    assert reader.wait_quiescent(15) and reader.snapshot().ring_live_bytes == 0
