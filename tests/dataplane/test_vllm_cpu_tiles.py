"""vLLM CPU's KV in host memory is copied run by run (dataplane/tiles.py), and bit-exact: every gather and scatter
leaves the staging buffer and the engine's memory byte-identical to what the per-element plane path leaves.

The oracle is that plane path on the same views: an `EngineKV` built from the tiled store's own K and V views under
another format (`vllm_hnd`), which copies through paged planes, K one element per (block, position) index. Cases
cover every dtype (fp8 held as uint8, as vLLM holds it), block sizes on both sides of a cache line per tile row,
chunks that start and end inside a block, head subsets, unaligned staging offsets, the engine's layers in one
allocation (layer-outer and block-outer, as vLLM allocates them) or in separate tensors, and slots in any order.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.dataplane import EngineKV, KVCacheFormat, gather, gather_slots, scatter, scatter_slots
from kvstage.dataplane.tiles import block_runs
from kvstage.errors import InvalidRequest
from kvstage.layout import KVLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": None}
ALLOCATIONS = ("layer-outer", "block-outer", "per-layer")
NUM_LAYERS, HEADS, HEAD_DIM, BLOCKS = 3, 4, 16, 12


def _layers(layout: KVLayout, allocation: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Random bytes as the engine's per-layer `[blocks, heads, block_size, 2 * head_dim]` tensors."""
    page = (HEADS, layout.page_size, 2 * layout.head_bytes)
    if allocation == "per-layer":
        raws = [torch.randint(0, 256, (BLOCKS, *page), dtype=torch.uint8, generator=gen) for _ in range(NUM_LAYERS)]
    elif allocation == "layer-outer":
        raws = list(torch.randint(0, 256, (NUM_LAYERS, BLOCKS, *page), dtype=torch.uint8, generator=gen).unbind(0))
    else:  # block-outer: each block holds every layer's page
        raws = list(torch.randint(0, 256, (BLOCKS, NUM_LAYERS, *page), dtype=torch.uint8, generator=gen).unbind(1))
    dtype = DTYPES[layout.dtype]
    return raws if dtype is None else [raw.view(dtype) for raw in raws]


def _pair(dtype: str, block_size: int, allocation: str, seed: int) -> tuple[EngineKV, EngineKV, list[torch.Tensor]]:
    """(the tiled store, the plane-path oracle over a copy of the same bytes, the tiled store's tensors)."""
    layout = KVLayout(NUM_LAYERS, HEADS, HEAD_DIM, dtype, block_size)
    layers = _layers(layout, allocation, torch.Generator().manual_seed(seed))
    twin = [t.clone() for t in layers] if allocation == "per-layer" else _clone_storage(layers)
    kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, layers, HEADS)
    views = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, twin, HEADS)
    keys, values = [views.k(i) for i in range(NUM_LAYERS)], [views.v(i) for i in range(NUM_LAYERS)]
    oracle = EngineKV(layout, KVCacheFormat.VLLM_HND, keys, values)
    assert kv.tiles is not None and oracle.tiles is None
    return kv, oracle, layers


def _clone_storage(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same views over a copy of the storage the layers share."""
    storage = layers[0].untyped_storage()
    copy = torch.empty(0, dtype=torch.uint8).set_(storage).clone().view(layers[0].dtype)
    return [copy.as_strided(t.shape, t.stride(), t.storage_offset()) for t in layers]


def _bytes(kv: EngineKV) -> torch.Tensor:
    """Every byte of a store's K and V views, `[2, L, blocks, block_size, heads, head_bytes]`."""
    views = [kv.k(i) for i in range(NUM_LAYERS)] + [kv.v(i) for i in range(NUM_LAYERS)]
    return torch.stack([v.contiguous().view(torch.uint8) for v in views])


def _stagings(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw, raw.clone()


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    start=st.integers(0, 300),
    length=st.integers(1, 300),
    head_start=st.integers(0, HEADS - 1),
    num_heads=st.integers(1, HEADS),
    offset=st.sampled_from([0, 64, 3]),
    seed=st.integers(0, 2**31),
)
def test_gather_and_scatter_match_the_plane_path_byte_for_byte(
    dtype, block_size, allocation, start, length, head_start, num_heads, offset, seed
):
    kv, oracle, _ = _pair(dtype, block_size, allocation, seed)
    capacity = BLOCKS * block_size
    start, num_heads = start % (capacity - 1), min(num_heads, HEADS - head_start)
    end = min(start + length, capacity)
    offset *= kv.layout.itemsize  # a multiple of the element: K moves in elements
    pages = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    size = offset + 2 * NUM_LAYERS * (end - start) * num_heads * kv.layout.head_bytes + 64
    got, want = _stagings(size, seed)
    assert gather(kv, pages, start, end, head_start, num_heads, got, offset) == size - offset - 64
    gather(oracle, pages, start, end, head_start, num_heads, want, offset)
    assert torch.equal(got, want)
    block, _ = _stagings(size, seed + 1)  # fresh bytes back into the engine
    scatter(block, offset, kv, pages, start, end, head_start, num_heads)
    scatter(block, offset, oracle, pages, start, end, head_start, num_heads)
    assert torch.equal(_bytes(kv), _bytes(oracle))


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_slots_in_any_order_are_served(dtype, allocation):
    """gather_slots and scatter_slots take any slots, not only a request's: then a run is one position or a few."""
    kv, oracle, _ = _pair(dtype, 16, allocation, seed=7)
    shuffled = torch.randperm(BLOCKS * 16, generator=torch.Generator().manual_seed(7))
    run = torch.arange(28, 36)  # consecutive slots across the end of block 1: two runs
    rest = shuffled[(shuffled < 28) | (shuffled >= 36)]
    slots = torch.cat([rest[:10], run, rest[10:40]])
    size = 2 * NUM_LAYERS * slots.numel() * 3 * kv.layout.head_bytes
    got, want = _stagings(size, 7)
    gather_slots(kv, slots, 1, 3, got, 0)
    gather_slots(oracle, slots, 1, 3, want, 0)
    assert torch.equal(got, want)
    scatter_slots(got.flip(0).contiguous(), 0, kv, slots, 1, 3)
    scatter_slots(got.flip(0).contiguous(), 0, oracle, slots, 1, 3)
    assert torch.equal(_bytes(kv), _bytes(oracle))


def test_runs_break_where_positions_stop_being_consecutive_or_a_block_ends():
    slots = torch.tensor([45, 46, 47, 48, 49, 5, 6, 100, 99])
    assert block_runs(slots, 16) == [(0, 2, 13, 3), (3, 3, 0, 2), (5, 0, 5, 2), (7, 6, 4, 1), (8, 6, 3, 1)]
    assert block_runs(torch.arange(16, 48), 16) == [(0, 1, 0, 16), (16, 2, 0, 16)]
    assert block_runs(torch.tensor([], dtype=torch.int64), 16) == []


@pytest.mark.parametrize(("allocation", "groups"), [("layer-outer", 1), ("block-outer", 1), ("per-layer", NUM_LAYERS)])
def test_layers_of_one_allocation_are_copied_at_once(allocation, groups):
    kv, _, layers = _pair("bfloat16", 16, allocation, seed=3)
    assert kv.tiles is not None and len(kv.tiles.groups) == groups
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    gather(kv, [4], 0, 16, 0, HEADS, staging, 0)
    keys = staging[: NUM_LAYERS * 16 * HEADS * kv.layout.head_bytes].view(torch.int16)
    for layer, tensor in enumerate(layers):  # K of block 4, layer `layer`: stored [head_dim, block_size] per head
        tile = tensor[4].view(torch.int16).reshape(HEADS, 2, HEAD_DIM * 16)[:, 0].view(HEADS, HEAD_DIM, 16)
        assert torch.equal(keys.view(NUM_LAYERS, 16, HEADS, HEAD_DIM)[layer], tile.permute(2, 0, 1))


def test_a_block_address_below_the_element_is_refused_before_anything_is_written():
    kv, _, _ = _pair("float32", 16, "layer-outer", seed=1)
    before = _bytes(kv)
    with pytest.raises(InvalidRequest, match="element by element"):
        scatter(torch.zeros(1 << 16, dtype=torch.uint8), 2, kv, [0, 1], 3, 20, 0, HEADS)
    assert torch.equal(_bytes(kv), before)
