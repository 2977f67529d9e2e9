"""Agents on the engine's own KV (`EngineKV`, vLLM's CPU layout) over real sockets and the local transport: prefill
gathers from the engine's tensors, decode scatters into its engine's tensors, bit-exact, for fan-in, fan-out and
equal TP; where every layer lies in one allocation (as vLLM allocates them) and both sides use one block size, a
matched-TP room writes decode's blocks page run to page run (cross-memory writes), with no ring byte."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from agent_outcomes import wait_outcomes

from kvstage.dataplane import EngineKV, KVCacheFormat
from kvstage.dataplane.engine_blocks import block_runs
from kvstage.errors import ConfigError
from kvstage.layout import ChunkGrid, KVLayout, heads_of_rank
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
    """One engine rank: its own per-layer vLLM CPU caches (random bytes to start), wrapped without a copy; with
    `one_allocation`, every layer is a view of one tensor, as vLLM allocates them."""

    def __init__(self, tp: int, rank: int, gen: torch.Generator, layout: KVLayout, one_allocation: bool) -> None:
        self.layout = layout
        self.heads = heads_of_rank(layout.num_kv_heads, tp, rank)
        pages = PAGES * LAYOUT.page_size // layout.page_size
        shape = (pages, len(self.heads), layout.page_size, 2 * layout.head_dim)
        if one_allocation:
            whole = torch.randint(-(2**15), 2**15, (layout.num_layers, *shape), dtype=torch.int16, generator=gen)
            self.layers = [layer.view(torch.bfloat16) for layer in whole]
        else:
            self.layers = [torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
                           for _ in range(layout.num_layers)]  # fmt: skip
        self.kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, self.layers, len(self.heads))
        self.free = torch.randperm(pages, generator=gen).tolist()

    def _index(self, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, ...]:
        size = self.layout.page_size
        rows = [(pages[t // size], t % size) for t in range(start, end)]
        return tuple(torch.tensor(axis) for axis in zip(*rows, strict=True))

    def tokens(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """`[2, L, tokens, heads, head_dim]` int16 of tokens `[start, end)` in `pages`, read from the engine caches."""
        index = self._index(pages, start, end)
        return torch.stack([torch.stack([view[index] for view in _vllm_cpu_views(layer)]) for layer in self.layers], 1)

    def write(self, pages: list[int], kv: torch.Tensor) -> None:
        """The engine computes `kv` (`[2, L, tokens, heads, head_dim]` int16) into its pages."""
        index = self._index(pages, 0, kv.shape[2])
        for layer, cache in enumerate(self.layers):
            for half, view in enumerate(_vllm_cpu_views(cache)):
                view[index] = kv[half, layer]

    def pages_for(self, tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-tokens // self.layout.page_size))]


class Cluster:
    def __init__(
        self, prefill_tp: int, decode_tp: int, *, one_allocation: bool = False, prefill_page_size: int = 0
    ) -> None:
        gen = torch.Generator().manual_seed(10 * prefill_tp + decode_tp)
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.bootstrap = BootstrapServer().start()
        prefill_layout = replace(LAYOUT, page_size=prefill_page_size or LAYOUT.page_size)
        self.prefill_ranks = [Rank(prefill_tp, r, gen, prefill_layout, one_allocation) for r in range(prefill_tp)]
        self.decode_ranks = [Rank(decode_tp, r, gen, LAYOUT, one_allocation) for r in range(decode_tp)]
        self.prefill = [self._start(PrefillAgent, "P", r, rank) for r, rank in enumerate(self.prefill_ranks)]
        self.decode = [self._start(DecodeAgent, "D", r, rank) for r, rank in enumerate(self.decode_ranks)]

    def _start(self, cls, instance: str, rank: int, engine: Rank):
        tp = self.prefill_tp if instance == "P" else self.decode_tp
        config = AgentConfig(instance=instance, rank=rank, tp_size=tp, layout=engine.layout,
                             bootstrap=self.bootstrap.address, timing=TIMING, chunk_tokens=CHUNK, ring_bytes=RING,
                             staging_bytes=RING)  # fmt: skip
        return cls(config, engine.kv).start()

    def close(self) -> None:
        for agent in self.decode + self.prefill:
            agent.close()
        self.bootstrap.close()


@dataclass
class Handoff:
    """What `hand_off` sent: each room's KV, and the pages it went from and to."""

    truth: dict[int, torch.Tensor] = field(default_factory=dict)
    prefill_pages: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    decode_pages: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    untouched: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)


def hand_off(cluster: Cluster, rooms: dict[int, tuple[int, int]]) -> Handoff:
    """Every room (room -> (tokens, decode prefix tokens)) from the prefill engines to the decode engines; waits
    until every agent reports every room succeeded and checks the KV landed, bit-exact, with the prefix untouched."""
    gen = torch.Generator().manual_seed(3)
    sent = Handoff()
    for room, (tokens, prefix) in rooms.items():
        sent.truth[room] = torch.randint(-(2**15), 2**15, (2, 2, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                                         dtype=torch.int16, generator=gen)  # fmt: skip
        for r, (agent, engine) in enumerate(zip(cluster.decode, cluster.decode_ranks, strict=True)):
            pages = sent.decode_pages[room, r] = engine.pages_for(tokens)
            sent.untouched[room, r] = engine.tokens(pages, 0, prefix) if prefix else None  # decode's cached prefix
            peers = tuple(peer_id("P", p) for p in range(cluster.prefill_tp))
            agent.expect_room(room, peers, tokens, prefix, tuple(pages), timeout_s=20)
        for r, (agent, engine) in enumerate(zip(cluster.prefill, cluster.prefill_ranks, strict=True)):
            pages = sent.prefill_pages[room, r] = engine.pages_for(tokens)
            engine.write(pages, sent.truth[room][:, :, :, engine.heads.start : engine.heads.stop])
            agent.attach_room(room, tokens, cluster.decode_tp, timeout_s=20)
            agent.compute_scheduled(room, tokens)
            agent.kv_ready(room, tokens, tuple(pages))
    for agent in cluster.decode + cluster.prefill:
        outcomes = wait_outcomes(agent, len(rooms))
        assert all(o.ok for o in outcomes.values()), outcomes
    for room, (tokens, prefix) in rooms.items():
        for r, engine in enumerate(cluster.decode_ranks):
            heads = engine.heads
            landed = engine.tokens(sent.decode_pages[room, r], prefix, tokens)
            assert torch.equal(landed, sent.truth[room][:, :, prefix:, heads.start : heads.stop]), (room, r)
            if prefix:
                assert torch.equal(engine.tokens(sent.decode_pages[room, r], 0, prefix), sent.untouched[room, r])
    return sent


@pytest.fixture
def make_cluster():
    made: list[Cluster] = []

    def make(prefill_tp: int, decode_tp: int, **options: Any) -> Cluster:
        made.append(Cluster(prefill_tp, decode_tp, **options))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


ROOMS = {1: (70, 0), 2: (16, 0), 3: (90, 32)}  # room -> (tokens, decode prefix tokens)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (1, 1)], ids=["P2-D1", "P1-D2", "P1-D1"])
def test_rooms_move_between_engine_owned_vllm_cpu_caches_bit_exact_and_leave_the_rings_empty(
    make_cluster, prefill_tp, decode_tp
):
    cluster = make_cluster(prefill_tp, decode_tp)
    hand_off(cluster, ROOMS)
    for agent in cluster.decode:
        assert agent.pool_region is None  # layers in allocations of their own: not exported, staged only
        assert agent.wait_quiescent(5) and agent.snapshot().ring_live_bytes == 0
        assert agent.metrics.value("kvstage_rooms", state="succeeded") == len(ROOMS)
    for agent in cluster.prefill:
        assert agent.wait_quiescent(5)
        assert agent.metrics.value("kvstage_transfer_bytes_total") > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_matched_tp_rooms_write_vllms_blocks_page_run_to_page_run_with_no_ring_byte(make_cluster, tp):
    cluster = make_cluster(tp, tp, one_allocation=True)
    sent = hand_off(cluster, ROOMS)
    for r, (writer, reader) in enumerate(zip(cluster.prefill, cluster.decode, strict=True)):
        assert reader.wait_quiescent(5) and writer.wait_quiescent(5)
        assert reader.metrics.value("kvstage_ring_high_water_bytes") == 0
        grid = ChunkGrid(CHUNK, LAYOUT.page_size)
        runs = [
            block_runs(writer.engine_blocks, reader.engine_blocks, src[grid.pages_of(c)], dst[grid.pages_of(c)])
            for room, (tokens, prefix) in ROOMS.items()
            for src, dst in [(sent.prefill_pages[room, r], sent.decode_pages[room, r])]
            for c in grid.chunks(tokens, prefix)
        ]
        assert writer.metrics.value("kvstage_transfer_ops_total") == sum(len(chunk) for chunk in runs)
        moved = sum(length for chunk in runs for *_, length in chunk)
        assert writer.metrics.value("kvstage_transfer_bytes_total") == moved


def test_matched_tp_rooms_between_different_block_sizes_stage(make_cluster):
    cluster = make_cluster(1, 1, one_allocation=True, prefill_page_size=32)
    hand_off(cluster, ROOMS)
    (decode,) = cluster.decode
    assert decode.wait_quiescent(5) and decode.snapshot().ring_live_bytes == 0
    assert decode.metrics.value("kvstage_ring_high_water_bytes") > 0


def test_an_agent_refuses_engine_kv_of_another_layout():
    engine = Rank(1, 0, torch.Generator().manual_seed(0), LAYOUT, one_allocation=False)
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


def test_a_matched_tp_room_waiting_for_its_writers_records_gives_its_pages_back_at_once_when_aborted(make_cluster):
    cluster = make_cluster(1, 1, one_allocation=True)
    (decode,) = cluster.decode
    pages = tuple(cluster.decode_ranks[0].pages_for(40))
    decode.expect_room(7, (peer_id("Q", 0),), 40, 0, pages, timeout_s=20)  # no instance Q has registered
    deadline = time.monotonic() + 5
    while 7 not in decode._unplaced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 7 in decode._unplaced and not decode.snapshot().quiescent  # its path waits for Q's record
    decode.abort(7)
    outcome = wait_outcomes(decode, 1)[7]
    assert (outcome.ok, outcome.reason, outcome.pages) == (False, "aborted by decode", pages)
    assert decode.wait_quiescent(5)
