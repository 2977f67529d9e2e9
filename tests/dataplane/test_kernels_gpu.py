"""The Triton gather/scatter kernels copy exactly what the torch path copies, byte for byte, on a GPU.

Reference: the torch path of dataplane.stage run on CPU copies of the same pools, slots and staging bytes. Every
dtype x page size {1, 16, 64} x (H, P, D) pair including replicated heads (TP > H), tokens starting mid-page and a
chunk tail; staging and pools start as random bytes, so an unwritten or stray byte shows. Engine layouts (per-layer
4-D views of any stride order, evenly spaced or not) are checked against plain indexing. A fan-in region's writer
blocks, scattered in one launch, land as the torch path lands them block by block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from kvstage.dataplane import EngineKV, KVCacheFormat, KVPool, gather_slots, queue_scatter_region, scatter_slots
from kvstage.errors import InvalidRequest
from kvstage.layout import DTYPE_BYTES, KVLayout, plan_staging

if TYPE_CHECKING:
    from kvstage.dataplane.kernels import KVAddress

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TP_PAIRS = [(8, 4, 2), (8, 2, 4), (8, 8, 1), (2, 4, 8), (1, 2, 8), (4, 1, 1), (6, 2, 3)]  # (H, P, D)
NUM_LAYERS, TOKEN_START = 3, 3


def _random_pool(layout: KVLayout, tp: int, rank: int, num_pages: int, gen: torch.Generator) -> KVPool:
    pool = KVPool.for_rank(layout, tp, rank, num_pages, "cuda")
    pool.flat.copy_(torch.randint(0, 256, pool.flat.shape, dtype=torch.uint8, generator=gen))
    pool.allocator.allocate(num_pages)
    return pool


def _address(pool: KVPool) -> KVAddress:
    from kvstage.dataplane.kernels import address_of

    address = address_of(pool)
    assert address is not None
    return address


def _on_cpu(pool: KVPool) -> KVPool:
    copy = KVPool(pool.layout, pool.num_heads, pool.geometry.num_pages)
    copy.flat.copy_(pool.flat.cpu())
    copy.allocator.allocate(pool.geometry.num_pages)
    return copy


@pytest.mark.parametrize(("h", "p", "d"), TP_PAIRS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_triton_gather_and_scatter_equal_the_torch_path_for_every_dtype(h: int, p: int, d: int, page_size: int) -> None:

    gen = torch.Generator().manual_seed(100 * h + 10 * p + d + page_size)
    for dtype in DTYPE_BYTES:
        head_dim = 96 if h == 6 else 64  # 6 heads: also head rows that are no power of two bytes
        layout = KVLayout(NUM_LAYERS, h, head_dim, dtype, page_size)
        num_tokens = 2 * page_size + 5
        num_pages = -(-(TOKEN_START + num_tokens) // page_size) + 3
        for decode_rank in range(d):
            plan = plan_staging(layout, p, d, decode_rank, num_tokens)
            dst = _random_pool(layout, d, decode_rank, num_pages, gen)
            dst_cpu = _on_cpu(dst)
            dst_pages = torch.randperm(num_pages, generator=gen).tolist()
            dst_slots = dst.slot_indices(dst_pages, TOKEN_START, TOKEN_START + num_tokens)
            dst_slots_cpu = dst_cpu.slot_indices(dst_pages, TOKEN_START, TOKEN_START + num_tokens)
            staging = torch.randint(0, 256, (plan.total_bytes + 7,), dtype=torch.uint8, generator=gen)
            expected, got = staging.clone(), staging.cuda()
            for block in plan.blocks:
                src = _random_pool(layout, p, block.prefill_rank, num_pages, gen)
                src_pages = torch.randperm(num_pages, generator=gen).tolist()
                src_slots = src.slot_indices(src_pages, TOKEN_START, TOKEN_START + num_tokens)
                heads = (block.transfer.src_head_start, block.transfer.num_heads)
                cpu = _on_cpu(src)
                cpu_slots = cpu.slot_indices(src_pages, TOKEN_START, TOKEN_START + num_tokens)
                offset = block.offset + 3  # also a block at an address no word divides
                assert gather_slots(cpu, cpu_slots, *heads, expected, offset) == block.nbytes
                assert _address(src).gather(src_slots, *heads, got, offset) == block.nbytes
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), expected), (dtype, decode_rank)
            for block in plan.blocks:
                heads = (block.transfer.dst_head_start, block.transfer.num_heads)
                scatter_slots(expected, block.offset + 3, dst_cpu, dst_slots_cpu, *heads)
                _address(dst).scatter(got, block.offset + 3, dst_slots, *heads)
            torch.cuda.synchronize()
            assert torch.equal(dst.flat.cpu(), dst_cpu.flat), (dtype, decode_rank)


@pytest.mark.parametrize(("h", "p", "d"), [(8, 4, 2), (8, 8, 1), (6, 3, 1), (8, 16, 2)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_fan_in_regions_blocks_scatter_in_one_launch_as_the_torch_path_does_block_by_block(
    h: int, p: int, d: int, page_size: int
) -> None:
    gen = torch.Generator().manual_seed(1000 + 100 * h + 10 * p + d + page_size)
    for dtype in DTYPE_BYTES:
        layout = KVLayout(NUM_LAYERS, h, 96 if h == 6 else 64, dtype, page_size)
        num_tokens = 2 * page_size + 5
        num_pages = -(-(TOKEN_START + num_tokens) // page_size) + 3
        plan = plan_staging(layout, p, d, 0, num_tokens)
        dst = _random_pool(layout, d, 0, num_pages, gen)
        dst_cpu = _on_cpu(dst)
        pages = torch.randperm(num_pages, generator=gen).tolist()
        staging = torch.randint(0, 256, (plan.total_bytes + 64,), dtype=torch.uint8, generator=gen)
        for block in plan.blocks:
            heads = (block.transfer.dst_head_start, block.transfer.num_heads)
            slots_cpu = dst_cpu.slot_indices(pages, TOKEN_START, TOKEN_START + num_tokens)
            scatter_slots(staging, 48 + block.offset, dst_cpu, slots_cpu, *heads)
        slots = dst.slot_indices(pages, TOKEN_START, TOKEN_START + num_tokens)
        assert queue_scatter_region(staging.cuda(), 48, plan, dst, slots) == plan.total_bytes
        torch.cuda.synchronize()
        assert torch.equal(dst.flat.cpu(), dst_cpu.flat), (dtype, len(plan.blocks))


def _engine_views(layout: KVLayout, heads: int, num_pages: int, order: str, spacing: int) -> list[torch.Tensor]:
    """2L views `[pages, page_size, heads, head_dim]` over random bytes: token-major ("nhd") or head-major ("hnd")
    storage, layer i at byte `i * (layer bytes) + spacing * i * i` of one buffer (`spacing` 0: evenly spaced)."""
    stored = (num_pages, layout.page_size, heads, layout.head_dim)
    if order == "hnd":
        stored = (num_pages, heads, layout.page_size, layout.head_dim)
    count, size = 2 * layout.num_layers, stored[0] * stored[1] * stored[2] * stored[3]
    buffer = torch.randint(0, 256, (count * size + spacing * count * count,), dtype=torch.uint8, device="cuda")
    tensors = [buffer[i * size + spacing * i * i :][:size].view(stored) for i in range(count)]
    return [t if order == "nhd" else t.transpose(1, 2) for t in tensors]


@pytest.mark.parametrize("order", ["nhd", "hnd"])
@pytest.mark.parametrize("spacing", [0, 48, 5])  # one stride; a layer table; a table of unaligned offsets
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_engine_layout_views_round_trip_bit_exact(order: str, spacing: int, page_size: int) -> None:
    from kvstage.dataplane import kernels

    layout = KVLayout(NUM_LAYERS, 4, 128, "float8_e4m3fn", page_size)
    num_pages, num_tokens, head_start, num_heads = 9, 3 * page_size + 1, 1, 2
    views = _engine_views(layout, 4, num_pages, order, spacing)
    paged = kernels.KVAddress.of_views(views)
    assert (paged.layer_table is None) == (spacing == 0)
    assert paged.table_align == (1 if spacing == 5 else 16)
    slots = torch.randperm(num_pages * page_size, device="cuda")[:num_tokens]
    rows = [v.reshape(-1, 4, layout.head_dim)[slots, head_start : head_start + num_heads] for v in views]
    expected = torch.stack(rows).flatten()
    staging = torch.randint(0, 256, (expected.numel() + 32,), dtype=torch.uint8, device="cuda")
    paged.gather(slots, head_start, num_heads, staging, 16)
    assert torch.equal(staging[16 : 16 + expected.numel()], expected)

    before = [v.clone() for v in views]
    block = torch.randint(0, 256, staging.shape, dtype=torch.uint8, device="cuda")
    paged.scatter(block, 16, slots, head_start, num_heads)
    written = block[16 : 16 + expected.numel()].view(2 * NUM_LAYERS, num_tokens, num_heads, layout.head_dim)
    for view, old, new in zip(views, before, written, strict=True):
        want = old.reshape(-1, 4, layout.head_dim)
        want[slots, head_start : head_start + num_heads] = new
        assert torch.equal(view.reshape(-1, 4, layout.head_dim), want)


def _engine_memory(fmt: KVCacheFormat, pages: int, page_size: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    """One layer's tensors in memory order (random 2-byte words): what `_engine_layer` views in `fmt`'s form."""
    tokens, shape = (
        pages * page_size,
        {
            KVCacheFormat.KVSTAGE: (2, pages * page_size, heads, head_dim),
            KVCacheFormat.VLLM_NHD: (pages, page_size, heads, 2 * head_dim),
        }.get(fmt, (pages, heads, page_size, 2 * head_dim)),
    )
    count, shape = (2, (tokens, heads, head_dim)) if fmt is KVCacheFormat.SGLANG else (1, shape)
    return [torch.randint(-(2**15), 2**15, shape, dtype=torch.int16) for _ in range(count)]


def _engine_layer(fmt: KVCacheFormat, memory: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if fmt is KVCacheFormat.SGLANG:
        return (memory[0], memory[1])
    return memory[0].transpose(1, 2) if fmt is KVCacheFormat.VLLM_NHD else memory[0]


@pytest.mark.parametrize("fmt", [f for f in KVCacheFormat if f is not KVCacheFormat.VLLM_MLA])  # multi-head formats
def test_stage_copies_an_engines_own_kv_on_the_gpu_as_its_torch_path_does_on_the_cpu(fmt: KVCacheFormat) -> None:
    layout = KVLayout(NUM_LAYERS, 4, 64, "bfloat16", 16)
    pages, num_tokens, head_start, num_heads = 7, 45, 1, 2
    memory = [_engine_memory(fmt, pages, 16, 4, 64) for _ in range(NUM_LAYERS)]
    on_gpu = [[t.cuda() for t in layer] for layer in memory]
    kv_cpu, kv_gpu = (
        EngineKV.from_layers(layout, fmt, [_engine_layer(fmt, layer) for layer in m], 4) for m in (memory, on_gpu)
    )
    page_list = torch.randperm(pages).tolist()
    slots_cpu, slots_gpu = (kv.slot_indices(page_list, 5, 5 + num_tokens) for kv in (kv_cpu, kv_gpu))
    staging = torch.randint(0, 256, (2 * NUM_LAYERS * num_tokens * num_heads * 128 + 64,), dtype=torch.uint8)
    staging_gpu = staging.cuda()
    gather_slots(kv_cpu, slots_cpu, head_start, num_heads, staging, 64)
    gather_slots(kv_gpu, slots_gpu, head_start, num_heads, staging_gpu, 64)
    assert torch.equal(staging_gpu.cpu(), staging)

    block = torch.randint(0, 256, staging.shape, dtype=torch.uint8)
    scatter_slots(block, 64, kv_cpu, slots_cpu, 0, num_heads)
    scatter_slots(block.cuda(), 64, kv_gpu, slots_gpu, 0, num_heads)
    for cpu_layer, gpu_layer in zip(memory, on_gpu, strict=True):
        assert all(torch.equal(c, g.cpu()) for c, g in zip(cpu_layer, gpu_layer, strict=True))


def test_a_block_that_does_not_fit_or_heads_outside_the_kv_are_refused_before_any_copy() -> None:

    layout = KVLayout(2, 2, 64, "bfloat16", 16)
    pool = KVPool(layout, 2, 4, "cuda")
    paged, slots = _address(pool), torch.arange(16, device="cuda")
    staging = torch.zeros(2 * 2 * 16 * 2 * 128 - 1, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidRequest, match="does not fit"):
        paged.gather(slots, 0, 2, staging, 0)
    with pytest.raises(InvalidRequest, match="head range"):
        paged.scatter(staging, 0, slots, 1, 2)
    with pytest.raises(InvalidRequest, match="slots must be"):
        paged.gather(slots.cpu(), 0, 1, staging, 0)
    assert not staging.any()
