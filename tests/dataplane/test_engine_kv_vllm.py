"""The `vllm_cpu` format is what vLLM's own CPU attention op writes: KV that `cpu_attn_reshape_and_cache` stored is
gathered bit-exact, and a scatter leaves the cache byte-identical to what that op would have written.

Needs the installed vLLM (vllm-cpu); skipped without it. Each case uses the kernel vLLM itself picks on this host
(`_get_attn_isa`); the tile-packed `amx` kernels are not a format kvstage reads (docs/integration.md).
"""

from __future__ import annotations

import pytest
import torch

from kvstage.dataplane import EngineKV, KVCacheFormat, gather, scatter
from kvstage.layout import KVLayout

ops = pytest.importorskip("vllm._custom_ops")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADS, BLOCKS, TOKENS = 2, 6, 70


def _case(dtype: str, block_size: int, head_dim: int):
    isa = cpu_attn._get_attn_isa(DTYPES[dtype], block_size, head_dim)
    if isa == "amx":
        pytest.skip("vLLM picks its tile-packed amx kernel on this host")
    layout = KVLayout(1, HEADS, head_dim, dtype, block_size)
    cache = torch.zeros(BLOCKS, HEADS, block_size, 2 * head_dim, dtype=DTYPES[dtype])
    return isa, layout, cache


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
