"""Staged and direct handoffs are bit-exact for every valid (H, P, D), dtype, page size, prefix and chunk tail.

World: a random "true" KV over all heads. Each prefill rank's pool holds its heads of it at random pages; each
decode rank's pool starts full of random garbage at random pages. After the handoff each decode pool must equal,
byte for byte, its garbage with exactly the transferred tokens of its own heads replaced by the true KV.
The expected values are computed here with plain per-token indexing, independently of the dataplane.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvstage.dataplane import KVPool, gather, gather_block, scatter_region, transfer_direct
from kvstage.errors import InvalidRequest
from kvstage.layout import DTYPE_BYTES, ChunkGrid, KVLayout, heads_of_rank, plan_head_transfers, plan_staging

SIZES = (1, 2, 4, 8)
VALID_HPD = [
    (h, p, d) for h in SIZES for p in SIZES for d in SIZES if (p <= h or p % h == 0) and (d <= h or d % h == 0)
]
DTYPES = tuple(DTYPE_BYTES)
NUM_LAYERS, HEAD_DIM, SPARE_PAGES = 2, 4, 5


@dataclass(frozen=True)
class Scenario:
    page_size: int
    num_tokens: int
    prefix_tokens: int
    chunk_tokens: int


SCENARIOS = (
    Scenario(page_size=1, num_tokens=13, prefix_tokens=3, chunk_tokens=4),  # chunks 4,4,2
    Scenario(page_size=16, num_tokens=75, prefix_tokens=16, chunk_tokens=32),  # chunks 32,27; tail mid-page
    Scenario(page_size=16, num_tokens=40, prefix_tokens=0, chunk_tokens=16),  # chunks 16,16,8
)


def test_valid_configurations_are_exactly_those_heads_of_rank_accepts() -> None:
    assert len(VALID_HPD) == 64  # powers of two: every replication or split is whole
    for h, p, d in VALID_HPD:
        heads_of_rank(h, p, p - 1)
        heads_of_rank(h, d, d - 1)


def _place(pool: KVPool, count: int, gen: torch.Generator) -> list[int]:
    """Allocate `count` pages of `pool` at random, non-contiguous positions, through its allocator."""
    everything = pool.allocator.allocate(pool.allocator.num_pages, owner="shuffle")
    order = torch.randperm(len(everything), generator=gen).tolist()
    pool.allocator.free([everything[i] for i in order])
    return pool.allocator.allocate(count, owner="request")


def _slots(pages: list[int], page_size: int, start: int, end: int) -> list[int]:
    return [pages[t // page_size] * page_size + t % page_size for t in range(start, end)]


def _heads_view(pool: KVPool) -> torch.Tensor:
    """`[2, L, slots, heads, head_bytes]` bytes of a pool, computed here from its documented layout."""
    g = pool.geometry
    return pool.flat.view(2, NUM_LAYERS, g.num_slots, g.num_heads, pool.layout.head_bytes)


@dataclass
class World:
    layout: KVLayout
    scenario: Scenario
    prefill: list[KVPool]
    prefill_pages: list[list[int]]
    decode: list[KVPool]
    decode_pages: list[list[int]]
    expected: list[torch.Tensor]


def _world(h: int, p: int, d: int, dtype: str, scenario: Scenario, seed: int, device: str = "cpu") -> World:
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(NUM_LAYERS, h, HEAD_DIM, dtype, scenario.page_size)
    n, ps = scenario.num_tokens, scenario.page_size
    num_pages = -(-n // ps) + SPARE_PAGES
    true_kv = torch.randint(0, 256, (2, NUM_LAYERS, n, h, layout.head_bytes), dtype=torch.uint8, generator=gen)
    true_kv = true_kv.to(device)
    prefill, prefill_pages = [], []
    for rank in range(p):
        pool = KVPool.for_rank(layout, p, rank, num_pages, device)
        pages = _place(pool, -(-n // ps), gen)
        heads = heads_of_rank(h, p, rank)
        _heads_view(pool)[:, :, _slots(pages, ps, 0, n)] = true_kv[:, :, :, heads.start : heads.stop]
        prefill.append(pool)
        prefill_pages.append(pages)
    decode, decode_pages, expected = [], [], []
    for rank in range(d):
        pool = KVPool.for_rank(layout, d, rank, num_pages, device)
        pages = _place(pool, -(-n // ps), gen)
        pool.flat.copy_(torch.randint(0, 256, pool.flat.shape, dtype=torch.uint8, generator=gen).to(device))
        want = pool.flat.clone()
        heads = heads_of_rank(h, d, rank)
        suffix = true_kv[:, :, scenario.prefix_tokens :, heads.start : heads.stop]
        want.view(_heads_view(pool).shape)[:, :, _slots(pages, ps, scenario.prefix_tokens, n)] = suffix
        decode.append(pool)
        decode_pages.append(pages)
        expected.append(want)
    return World(layout, scenario, prefill, prefill_pages, decode, decode_pages, expected)


def _staged_handoff(world: World, h: int, p: int, d: int, staging_device: str | None = None) -> int:
    """Every chunk, every decode rank: each writer gathers into the chunk's region, then decode scatters it.

    The staging region is on the pools' device unless `staging_device` names another (host staging of GPU pools).
    Returns the writer blocks moved (the bulk writes a transport would issue).
    """
    blocks = 0
    s = world.scenario
    grid = ChunkGrid(s.chunk_tokens, s.page_size)
    for chunk in grid.chunks(s.num_tokens, s.prefix_tokens):
        for rank in range(d):
            plan = plan_staging(world.layout, p, d, rank, chunk.num_tokens)
            region_offset = (5, 64, 2)[chunk.index % 3]  # copies through 1-, 8- (or head-size-) and 2-byte words
            device = staging_device or world.decode[0].device
            staging = torch.zeros(region_offset + plan.total_bytes, dtype=torch.uint8, device=device)
            for block in plan.blocks:
                writer = block.prefill_rank
                written = gather_block(
                    world.prefill[writer], world.prefill_pages[writer], chunk, block, staging, region_offset
                )
                assert written == block.nbytes
                blocks += 1
            read = scatter_region(staging, region_offset, plan, world.decode[rank], world.decode_pages[rank], chunk)
            assert read == plan.total_bytes
    return blocks


@pytest.mark.parametrize(("h", "p", "d"), VALID_HPD)
def test_staged_gather_then_scatter_gives_every_decode_rank_exactly_its_heads(h: int, p: int, d: int) -> None:
    for dtype_index, dtype in enumerate(DTYPES):
        for scenario_index, scenario in enumerate(SCENARIOS):
            world = _world(
                h, p, d, dtype, scenario, seed=1000 * h + 100 * p + 10 * d + 3 * dtype_index + scenario_index
            )
            assert _staged_handoff(world, h, p, d) == len(plan_head_transfers(h, p, d)) * len(
                ChunkGrid(scenario.chunk_tokens, scenario.page_size).chunks(scenario.num_tokens, scenario.prefix_tokens)
            )
            for rank, pool in enumerate(world.decode):
                assert torch.equal(pool.flat, world.expected[rank]), (dtype, scenario, rank)


def _direct_handoff(world: World, h: int, p: int, d: int) -> int:
    """Every head transfer of the whole suffix, slice by slice; returns the operations issued."""
    s = world.scenario
    return sum(
        transfer_direct(
            world.prefill[t.prefill_rank],
            world.decode[t.decode_rank],
            t,
            world.prefill_pages[t.prefill_rank],
            world.decode_pages[t.decode_rank],
            s.prefix_tokens,
            s.num_tokens,
        )
        for t in plan_head_transfers(h, p, d)
    )


@pytest.mark.parametrize(("h", "p", "d"), VALID_HPD)
def test_direct_per_slice_path_is_bit_exact_and_issues_one_op_per_layer_kv_page_and_run(h: int, p: int, d: int) -> None:
    runs = len(plan_head_transfers(h, p, d))
    for dtype in ("float32", "float8_e5m2"):
        for scenario in SCENARIOS[:2]:
            world = _world(h, p, d, dtype, scenario, seed=7 * h + 11 * p + 13 * d)
            ps = scenario.page_size
            pages_touched = -(-scenario.num_tokens // ps) - scenario.prefix_tokens // ps
            assert _direct_handoff(world, h, p, d) == NUM_LAYERS * 2 * pages_touched * runs
            for rank, pool in enumerate(world.decode):
                assert torch.equal(pool.flat, world.expected[rank]), (dtype, scenario, rank)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("h", "p", "d"), [(8, 4, 2), (2, 1, 4), (2, 4, 8), (8, 8, 1), (1, 2, 8)])
def test_staged_and_direct_handoffs_are_bit_exact_on_cuda(h: int, p: int, d: int) -> None:
    for dtype in DTYPES:
        for scenario in SCENARIOS:
            for handoff in (_staged_handoff, _direct_handoff):
                world = _world(h, p, d, dtype, scenario, seed=h + p + d, device="cuda")
                handoff(world, h, p, d)
                for rank, pool in enumerate(world.decode):
                    assert pool.flat.is_cuda
                    assert torch.equal(pool.flat, world.expected[rank]), (dtype, scenario, rank, handoff)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("h", "p", "d"), [(8, 4, 2), (2, 1, 4), (8, 8, 1)])
def test_gpu_pools_staged_through_host_memory_are_bit_exact(h: int, p: int, d: int) -> None:
    for dtype in DTYPES:
        for scenario in SCENARIOS:
            world = _world(h, p, d, dtype, scenario, seed=3 * h + p + d, device="cuda")
            _staged_handoff(world, h, p, d, staging_device="cpu")
            for rank, pool in enumerate(world.decode):
                assert torch.equal(pool.flat, world.expected[rank]), (dtype, scenario, rank)


def test_staging_on_another_accelerator_than_the_pool_is_refused() -> None:
    layout = KVLayout(1, 2, 8, "float32", 4)
    pool = KVPool(layout, 2, 3)
    pages = pool.allocator.allocate(1)
    staging = torch.zeros(4096, dtype=torch.uint8, device="meta")
    with pytest.raises(InvalidRequest, match="staging is on meta"):
        gather(pool, pages, 0, 4, 0, 2, staging, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_payloads_and_negative_zero_survive_a_round_trip(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    layout = KVLayout(1, 2, 8, name, 4)
    src, dst = KVPool(layout, 2, 3), KVPool(layout, 2, 3)
    src_pages, dst_pages = src.allocator.allocate(2), dst.allocator.allocate(2)[::-1]
    word = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    bits = torch.iinfo(word).bits
    specials = torch.tensor([-(2 ** (bits - 1)), -1, -2, 2 ** (bits - 1) - 1, -(2 ** (bits - 2)) - 1], dtype=word)
    src.kv.view(word)[..., :5] = specials  # -0.0 and NaNs with sign and payload bits set
    assert torch.isnan(src.kv[..., 1:]).any() and (src.kv[..., 0] == 0).all()
    staging = torch.zeros(layout.bytes_per_token() * 8, dtype=torch.uint8)
    grid = ChunkGrid(8, 4)
    chunk = grid.chunk(0, 8)
    plan = plan_staging(layout, 1, 1, 0, chunk.num_tokens)
    gather_block(src, src_pages, chunk, plan.blocks[0], staging, 0)
    scatter_region(staging, 0, plan, dst, dst_pages, chunk)
    src_slots = torch.tensor(_slots(src_pages, 4, 0, 8))
    dst_slots = torch.tensor(_slots(dst_pages, 4, 0, 8))
    assert torch.equal(dst.kv.view(word)[:, :, dst_slots], src.kv.view(word)[:, :, src_slots])
