"""KV pool geometry, page allocator bookkeeping, and the errors gather/scatter/direct raise on bad input."""

from __future__ import annotations

import pytest
import torch

from kvstage.dataplane import (
    KVPool,
    PageAllocator,
    PoolGeometry,
    SliceCopy,
    StagingBuffer,
    gather,
    gather_block,
    plan_direct_slices,
    scatter,
    transfer_direct,
)
from kvstage.errors import InvalidRequest, KVPoolExhausted
from kvstage.layout import ChunkGrid, KVLayout, plan_head_transfers, plan_staging

LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=4)


def _pool(num_heads: int = 2, num_pages: int = 6) -> KVPool:
    return KVPool(LAYOUT, num_heads, num_pages)


def test_pool_tensors_have_the_documented_shapes_and_share_one_flat_byte_buffer() -> None:
    pool = KVPool.for_rank(LAYOUT, tp_size=2, rank=1, num_pages=6)
    assert pool.num_heads == 2
    assert pool.k(2).shape == pool.v(0).shape == (24, 2, 8)
    assert pool.kv.dtype == torch.bfloat16
    assert pool.flat.dtype == torch.uint8 and pool.flat.dim() == 1 and pool.flat.is_contiguous()
    assert pool.flat.numel() == pool.geometry.nbytes == 2 * 3 * 24 * 2 * 8 * 2
    pool.v(1)[5, 1] = 1.5
    assert pool.flat.view(torch.bfloat16).max() == 1.5


@pytest.mark.parametrize(("kv", "layer", "slot", "head"), [(0, 0, 0, 0), (1, 2, 23, 1), (0, 1, 7, 1), (1, 0, 13, 0)])
def test_byte_offset_is_the_address_of_that_element_in_the_flat_buffer(
    kv: int, layer: int, slot: int, head: int
) -> None:
    pool = _pool()
    element = pool.kv[kv, layer, slot, head]
    assert pool.geometry.byte_offset(kv, layer, slot, head) == element.data_ptr() - pool.flat.data_ptr()


def test_byte_offset_rejects_coordinates_outside_the_pool() -> None:
    geometry = PoolGeometry(LAYOUT, 2, 6)
    for args in ((2, 0, 0, 0), (0, 3, 0, 0), (0, 0, 24, 0), (0, 0, 0, 2), (-1, 0, 0, 0)):
        with pytest.raises(InvalidRequest, match="outside"):
            geometry.byte_offset(*args)


def test_allocator_counts_pages_and_reports_leaks_by_owner() -> None:
    allocator = PageAllocator(8)
    a = allocator.allocate(3, owner="room-a")
    b = allocator.allocate(2, owner="room-b")
    assert allocator.in_use == 5 and allocator.num_free == 3
    assert allocator.owner_of(b[0]) == "room-b"
    allocator.free(a)
    assert allocator.leaked() == {"room-b": tuple(sorted(b))}
    allocator.free(b)
    assert allocator.leaked() == {} and allocator.in_use == 0 and allocator.num_free == 8


def test_allocator_refuses_double_free_and_foreign_pages_without_changing_state() -> None:
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages[:1])
    with pytest.raises(InvalidRequest, match="double free"):
        allocator.free(pages)  # pages[0] already free; pages[1] must stay held
    with pytest.raises(InvalidRequest, match="double free"):
        allocator.free([pages[1], pages[1]])
    with pytest.raises(InvalidRequest, match="do not belong"):
        allocator.free([4])
    assert allocator.in_use == 1 and allocator.owner_of(pages[1]) is None


def test_allocator_exhaustion_takes_nothing_and_freed_pages_are_reused_last() -> None:
    allocator = PageAllocator(3)
    first = allocator.allocate(2)
    with pytest.raises(KVPoolExhausted, match="2 pages requested, 1 of 3 free"):
        allocator.allocate(2)
    assert allocator.in_use == 2
    allocator.free(first[::-1])
    assert allocator.allocate(3) == [2, first[1], first[0]]


def _staging_setup() -> tuple[KVPool, list[int], torch.Tensor]:
    pool = _pool()
    pages = pool.allocator.allocate(3)
    return pool, pages, StagingBuffer(4096).flat


def test_gather_rejects_pages_outside_the_pool_repeated_or_missing() -> None:
    pool, pages, staging = _staging_setup()
    with pytest.raises(InvalidRequest, match="outside this pool"):
        gather(pool, [pages[0], 99, pages[2]], 0, 12, 0, 2, staging, 0)
    with pytest.raises(InvalidRequest, match="repeat a page"):
        gather(pool, [pages[0], pages[0], pages[2]], 0, 12, 0, 2, staging, 0)
    with pytest.raises(InvalidRequest, match="need 4 pages"):
        gather(pool, pages, 0, 13, 0, 2, staging, 0)
    with pytest.raises(InvalidRequest, match="empty or negative"):
        gather(pool, pages, 5, 5, 0, 2, staging, 0)


def test_scatter_refuses_pages_that_are_not_allocated() -> None:
    pool, pages, staging = _staging_setup()
    pool.allocator.free(pages[1:2])
    with pytest.raises(InvalidRequest, match=rf"pages \[{pages[1]}\] are not allocated"):
        scatter(staging, 0, pool, pages, 0, 12, 0, 2)


def test_a_request_looked_up_once_gives_each_chunk_the_slots_a_lookup_of_its_own_would() -> None:
    pool = _pool(num_pages=8)
    pages = pool.allocator.allocate(5)
    looked_up = pool.request_slots(pages, 4, 19)  # a cached prefix of one page; 15 tokens to move
    for start, end in ((4, 8), (8, 16), (16, 19), (5, 7), (4, 19)):
        assert torch.equal(looked_up.range(start, end), pool.slot_indices(pages, start, end))
    for start, end in ((0, 4), (3, 8), (16, 20), (8, 8)):
        with pytest.raises(InvalidRequest, match="outside the looked-up range"):
            looked_up.range(start, end)


def test_a_request_looked_up_once_still_refuses_a_chunk_whose_pages_were_freed_since() -> None:
    pool = _pool(num_pages=8)
    pages = pool.allocator.allocate(4)
    looked_up = pool.request_slots(pages, 0, 16)
    pool.allocator.free(pages[2:3])
    assert torch.equal(looked_up.range(0, 8), pool.slot_indices(pages, 0, 8))  # pages 0 and 1: still held
    with pytest.raises(InvalidRequest, match=rf"pages \[{pages[2]}\] are not allocated"):
        looked_up.range(4, 12)


def test_gather_and_scatter_reject_head_ranges_outside_the_pool() -> None:
    pool, pages, staging = _staging_setup()
    for head_start, num_heads in ((1, 2), (2, 1), (-1, 1), (0, 0)):
        with pytest.raises(InvalidRequest, match="head range"):
            gather(pool, pages, 0, 4, head_start, num_heads, staging, 0)
        with pytest.raises(InvalidRequest, match="head range"):
            scatter(staging, 0, pool, pages, 0, 4, head_start, num_heads)


def test_gather_and_scatter_reject_a_staging_buffer_too_small_for_the_block() -> None:
    pool, pages, _ = _staging_setup()
    need = 2 * 3 * 12 * 2 * 16
    staging = torch.full((need,), 7, dtype=torch.uint8)
    with pytest.raises(InvalidRequest, match="does not fit"):
        gather(pool, pages, 0, 12, 0, 2, staging, 1)
    with pytest.raises(InvalidRequest, match="does not fit"):
        scatter(staging[:-1], 0, pool, pages, 0, 12, 0, 2)
    assert (staging == 7).all() and (pool.flat == 0).all()  # nothing written before the check
    assert gather(pool, pages, 0, 12, 0, 2, staging, 0) == need


def test_gather_writes_only_its_block_and_scatter_reads_it_back_into_the_same_slots() -> None:
    pool, pages, _ = _staging_setup()
    pool.flat.copy_(
        torch.randint(0, 256, pool.flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    )
    staging = torch.full((2000,), 0xAB, dtype=torch.uint8)
    written = gather(pool, pages, 2, 9, 1, 1, staging, 7)
    assert written == 2 * 3 * 7 * 1 * 16
    assert (staging[:7] == 0xAB).all() and (staging[7 + written :] == 0xAB).all()
    before = pool.flat.clone()
    pool.flat.zero_()
    scatter(staging, 7, pool, pages, 2, 9, 1, 1)
    slots = [pages[t // 4] * 4 + t % 4 for t in range(2, 9)]
    view, want = pool.flat.view(2, 3, 24, 2, 16), before.view(2, 3, 24, 2, 16)
    assert torch.equal(view[:, :, slots, 1], want[:, :, slots, 1])
    assert int(torch.count_nonzero(pool.flat)) == int(torch.count_nonzero(view[:, :, slots, 1]))


def test_staging_must_be_a_flat_byte_tensor() -> None:
    pool, pages, _ = _staging_setup()
    with pytest.raises(InvalidRequest, match="contiguous 1-D uint8"):
        gather(pool, pages, 0, 4, 0, 2, torch.zeros(4096, dtype=torch.int16), 0)
    with pytest.raises(InvalidRequest, match="contiguous 1-D uint8"):
        gather(pool, pages, 0, 4, 0, 2, torch.zeros(64, 64, dtype=torch.uint8), 0)


def test_a_block_planned_for_another_chunk_size_is_refused() -> None:
    pool, pages, staging = _staging_setup()
    chunk = ChunkGrid(8, 4).chunk(1, 12)  # 4 tokens
    block = plan_staging(LAYOUT, 2, 2, 0, 8).blocks[0]
    with pytest.raises(InvalidRequest, match="planned for another chunk size"):
        gather_block(pool, pages, chunk, block, staging, 0)


def test_direct_path_rejects_mismatched_layouts_and_unallocated_pages() -> None:
    transfer = plan_head_transfers(4, 2, 2)[0]
    other = KVLayout(3, 4, 8, "float16", 4)
    with pytest.raises(InvalidRequest, match="differs"):
        plan_direct_slices(PoolGeometry(LAYOUT, 2, 6), PoolGeometry(other, 2, 6), transfer, [0], [0], 0, 4)
    src, dst = _pool(), _pool()
    src_pages = src.allocator.allocate(1)
    with pytest.raises(InvalidRequest, match="not allocated"):
        transfer_direct(src, dst, transfer, src_pages, [0], 0, 4)


def test_direct_slices_are_strided_rows_unless_the_run_covers_whole_slots() -> None:
    transfer = plan_head_transfers(4, 4, 2)[0]  # one head of a two-head decode rank
    slices = plan_direct_slices(PoolGeometry(LAYOUT, 1, 6), PoolGeometry(LAYOUT, 2, 6), transfer, [3], [5], 1, 4)
    assert len(slices) == 2 * 3
    first = slices[0]
    assert (first.rows, first.row_bytes, first.src_stride, first.dst_stride) == (3, 16, 16, 32)
    assert not first.contiguous and first.writes == 3 and first.nbytes == 48
    assert first.dst_offset == PoolGeometry(LAYOUT, 2, 6).byte_offset(0, 0, 5 * 4 + 1, 0)
    whole = plan_direct_slices(
        PoolGeometry(LAYOUT, 2, 6), PoolGeometry(LAYOUT, 2, 6), plan_head_transfers(4, 2, 2)[0], [3], [5], 0, 4
    )
    assert all(s.contiguous and s.writes == 1 for s in whole)


def test_a_slice_is_one_write_when_both_sides_are_contiguous_else_one_per_row() -> None:
    assert SliceCopy(100, 900, 64, 3, 64, 64).runs() == [(100, 900, 192)]
    assert SliceCopy(100, 900, 64, 1, 256, 512).runs() == [(100, 900, 64)]
    strided = SliceCopy(100, 900, 64, 3, 128, 256)
    assert strided.runs() == [(100, 900, 64), (228, 1156, 64), (356, 1412, 64)]
    assert len(strided.runs()) == strided.writes and sum(n for _, _, n in strided.runs()) == strided.nbytes


@pytest.mark.parametrize(("src_page", "dst_page", "shift"), [(4, 8, 0), (8, 4, 4), (8, 4, 0), (4, 4, 0)])
def test_a_direct_copy_between_page_sizes_lands_every_token_and_no_slice_crosses_a_page(
    src_page: int, dst_page: int, shift: int
) -> None:
    src = KVPool(KVLayout(3, 4, 8, "bfloat16", src_page), 2, 8)
    dst = KVPool(KVLayout(3, 4, 8, "bfloat16", dst_page), 2, 8)
    src.kv.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, src.kv.shape, dtype=torch.int16))
    src_pages, dst_pages = src.allocator.allocate(5), dst.allocator.allocate(5)
    transfer = plan_head_transfers(4, 2, 2)[1]
    start, end = 8, 19  # tokens of dst_pages; the source holds them `shift` tokens later
    slices = plan_direct_slices(src.geometry, dst.geometry, transfer, src_pages, dst_pages, start, end, src_shift=shift)
    assert transfer_direct(src, dst, transfer, src_pages, dst_pages, start, end, src_shift=shift) == len(slices)
    smallest = min(src_page, dst_page)
    assert all(s.rows <= smallest for s in slices)
    assert len(slices) == 2 * 3 * len(range(start // smallest, -(-end // smallest)))
    read = src.slot_indices(src_pages, start + shift, end + shift)
    written = dst.slot_indices(dst_pages, start, end)
    assert torch.equal(dst.kv[:, :, written].view(torch.int16), src.kv[:, :, read].view(torch.int16))
