"""Agents on the engine's own KV (`EngineKV`, vLLM's CPU layout) over real sockets and the local shared-memory
transport: prefill gathers from the engine's tensors, decode scatters into its engine's tensors, bit-exact, for
fan-in, fan-out and equal TP (staged too: the direct path only reaches a KVPool)."""

from __future__ import annotations

import pytest
import torch
from agent_outcomes import wait_outcomes

from kvstage.dataplane import EngineKV, KVCacheFormat
from kvstage.errors import ConfigError
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.bootstrap import BootstrapServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=16)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=2.0, retry_initial_s=0.02, retry_max_s=0.2)
PAGES, CHUNK, RING = 24, 32, 1 << 16


def _vllm_cpu_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[blocks, block_size, heads, head_dim]` of one vLLM CPU layer `[blocks, heads, block_size, 2*head_dim]`
    as int16 (bit-exact), by vLLM's layout: per (block, head), K transposed `[head_dim, block_size]`, then V."""
    b, h, n, _ = cache.shape
    halves = cache.view(torch.int16).view(b, h, 2, n * LAYOUT.head_dim)
    k = halves[:, :, 0].view(b, h, LAYOUT.head_dim, n).permute(0, 3, 1, 2)
    return k, halves[:, :, 1].view(b, h, n, LAYOUT.head_dim).transpose(1, 2)


class Rank:
    """One engine rank: its own per-layer vLLM CPU caches (random bytes to start), wrapped without a copy."""

    def __init__(self, tp: int, rank: int, gen: torch.Generator) -> None:
        self.heads = heads_of_rank(LAYOUT.num_kv_heads, tp, rank)
        shape = (PAGES, len(self.heads), LAYOUT.page_size, 2 * LAYOUT.head_dim)
        self.layers = [torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen) for _ in range(2)]
        self.layers = [layer.view(torch.bfloat16) for layer in self.layers]
        self.kv = EngineKV.from_layers(LAYOUT, KVCacheFormat.VLLM_CPU, self.layers, len(self.heads))
        self.free = torch.randperm(PAGES, generator=gen).tolist()

    def tokens(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """`[2, L, tokens, heads, head_dim]` int16 of tokens `[start, end)` in `pages`, read from the engine caches."""
        rows = [(pages[t // LAYOUT.page_size], t % LAYOUT.page_size) for t in range(start, end)]
        index = tuple(torch.tensor(axis) for axis in zip(*rows, strict=True))
        return torch.stack([torch.stack([view[index] for view in _vllm_cpu_views(layer)]) for layer in self.layers], 1)

    def write(self, pages: list[int], kv: torch.Tensor) -> None:
        """The engine computes `kv` (`[2, L, tokens, heads, head_dim]` int16) into its pages."""
        rows = [(pages[t // LAYOUT.page_size], t % LAYOUT.page_size) for t in range(kv.shape[2])]
        index = tuple(torch.tensor(axis) for axis in zip(*rows, strict=True))
        for layer, cache in enumerate(self.layers):
            for half, view in enumerate(_vllm_cpu_views(cache)):
                view[index] = kv[half, layer]


class Cluster:
    def __init__(self, prefill_tp: int, decode_tp: int) -> None:
        gen = torch.Generator().manual_seed(10 * prefill_tp + decode_tp)
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.bootstrap = BootstrapServer().start()
        self.prefill_ranks = [Rank(prefill_tp, r, gen) for r in range(prefill_tp)]
        self.decode_ranks = [Rank(decode_tp, r, gen) for r in range(decode_tp)]
        self.prefill = [self._start(PrefillAgent, "P", r, rank) for r, rank in enumerate(self.prefill_ranks)]
        self.decode = [self._start(DecodeAgent, "D", r, rank) for r, rank in enumerate(self.decode_ranks)]

    def _start(self, cls, instance: str, rank: int, engine: Rank):
        tp = self.prefill_tp if instance == "P" else self.decode_tp
        config = AgentConfig(instance=instance, rank=rank, tp_size=tp, layout=LAYOUT, bootstrap=self.bootstrap.address,
                             timing=TIMING, chunk_tokens=CHUNK, ring_bytes=RING, staging_bytes=RING)  # fmt: skip
        return cls(config, engine.kv).start()

    def close(self) -> None:
        for agent in self.decode + self.prefill:
            agent.close()
        self.bootstrap.close()


@pytest.fixture
def make_cluster():
    made: list[Cluster] = []

    def make(prefill_tp: int, decode_tp: int) -> Cluster:
        made.append(Cluster(prefill_tp, decode_tp))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (1, 1)], ids=["P2-D1", "P1-D2", "P1-D1"])
def test_rooms_move_between_engine_owned_vllm_cpu_caches_bit_exact_and_leave_the_rings_empty(
    make_cluster, prefill_tp, decode_tp
):
    cluster = make_cluster(prefill_tp, decode_tp)
    rooms = {1: (70, 0), 2: (16, 0), 3: (90, 32)}  # room -> (tokens, decode prefix tokens)
    gen = torch.Generator().manual_seed(3)
    truth, decode_pages, untouched = {}, {}, {}
    for room, (tokens, prefix) in rooms.items():
        npages = -(-tokens // LAYOUT.page_size)
        truth[room] = torch.randint(-(2**15), 2**15, (2, 2, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                                    dtype=torch.int16, generator=gen)  # fmt: skip
        for r, (agent, engine) in enumerate(zip(cluster.decode, cluster.decode_ranks, strict=True)):
            pages = decode_pages[room, r] = [engine.free.pop() for _ in range(npages)]
            untouched[room, r] = engine.tokens(pages, 0, prefix) if prefix else None  # decode's cached prefix
            agent.expect_room(room, tuple(peer_id("P", p) for p in range(prefill_tp)), tokens, prefix, tuple(pages),
                              timeout_s=20)  # fmt: skip
        for agent, engine in zip(cluster.prefill, cluster.prefill_ranks, strict=True):
            pages = [engine.free.pop() for _ in range(npages)]
            engine.write(pages, truth[room][:, :, :, engine.heads.start : engine.heads.stop])
            agent.attach_room(room, tokens, decode_tp, timeout_s=20)
            agent.compute_scheduled(room, tokens)
            agent.kv_ready(room, tokens, tuple(pages))

    for agent in cluster.decode + cluster.prefill:
        outcomes = wait_outcomes(agent, len(rooms))
        assert all(o.ok for o in outcomes.values()), outcomes
    for room, (tokens, prefix) in rooms.items():
        for r, engine in enumerate(cluster.decode_ranks):
            heads = engine.heads
            landed = engine.tokens(decode_pages[room, r], prefix, tokens)
            assert torch.equal(landed, truth[room][:, :, prefix:, heads.start : heads.stop]), (room, r)
            if prefix:
                assert torch.equal(engine.tokens(decode_pages[room, r], 0, prefix), untouched[room, r])
    for agent in cluster.decode:
        assert agent.pool_region is None  # the engine's memory is never registered: no direct path to it
        assert agent.wait_quiescent(5) and agent.snapshot().ring_live_bytes == 0
        assert agent.metrics.value("kvstage_rooms", state="succeeded") == len(rooms)
    for agent in cluster.prefill:
        assert agent.wait_quiescent(5)
        assert agent.metrics.value("kvstage_transfer_bytes_total") > 0


def test_an_agent_refuses_engine_kv_of_another_layout():
    engine = Rank(1, 0, torch.Generator().manual_seed(0))
    other = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=32)
    config = AgentConfig(instance="D", rank=0, tp_size=1, layout=other, bootstrap="tcp://127.0.0.1:1",
                         chunk_tokens=CHUNK, ring_bytes=RING)  # fmt: skip
    with pytest.raises(ConfigError, match="differs from the agent's layout"):
        DecodeAgent(config, engine.kv)


def test_decode_on_engine_kv_refuses_pages_outside_the_engines_tensors_at_once_and_keeps_serving(make_cluster):
    """The engine vouches for its pages; kvstage still checks their bounds and distinctness, before anything moves."""
    cluster = make_cluster(2, 1)
    decode = cluster.decode[0]
    peers = (peer_id("P", 0), peer_id("P", 1))
    decode.expect_room(5, peers, 32, 0, (0, PAGES), timeout_s=20)  # page PAGES does not exist
    decode.expect_room(6, peers, 32, 0, (3, 3), timeout_s=20)  # a page twice
    outcomes = wait_outcomes(decode, 2)
    assert "outside" in outcomes[5].reason and outcomes[5].reason.startswith("invalid request")
    assert "repeat" in outcomes[6].reason and outcomes[6].pages == (3, 3)
    assert decode.metrics.value("kvstage_room_failures_total", reason="invalid request") == 2
    assert decode.wait_quiescent(5)
