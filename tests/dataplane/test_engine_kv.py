"""Gather and scatter on an engine's own KV (`EngineKV`) are bit-exact for every format, dtype, TP pair and page size,
and they read and write the engine's tensors in place.

World: a random "true" KV over all heads. Each prefill rank's engine tensors (in one format) hold its heads of it at
random pages; each decode rank's engine tensors (in a format drawn independently) start full of random bytes. After
the staged handoff, each decode rank's KV must equal its random bytes with exactly the transferred tokens of its own
heads replaced by the true KV. The expected values come from a plain reference that reads every format with its
documented formula (docs/integration.md, "Engine-owned KV"), independently of kvstage.dataplane.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.dataplane import EngineKV, KVCacheFormat, KVPool, gather, gather_block, scatter, scatter_region
from kvstage.errors import ConfigError, InvalidRequest
from kvstage.layout import ChunkGrid, KVLayout, heads_of_rank, plan_staging

#: Multi-head formats; MLA's latent (`vllm_mla`, one head on every rank) has tests of its own
#: (tests/dataplane/test_engine_kv_vllm_mla.py, tests/dataplane/test_mla_engine_kv.py).
FORMATS = tuple(f for f in KVCacheFormat if f is not KVCacheFormat.VLLM_MLA)
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
TP_PAIRS = {"fan-in": (4, 4, 2), "fan-out": (4, 1, 2), "replicated heads": (2, 4, 8), "equal": (4, 2, 2)}
PAGE_SIZES = (1, 16, 128)
NUM_LAYERS, HEAD_DIM = 2, 8
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _random(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> torch.Tensor:
    """Random bytes (NaN payloads, -0.0 and all) as a tensor of `dtype`; fp8 is held as uint8, as vLLM holds it."""
    itemsize = 4 if dtype == "float32" else 1 if dtype.startswith("float8") else 2
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw if itemsize == 1 else raw.view(TORCH[dtype])


def _engine_tensors(fmt: KVCacheFormat, pages: int, page_size: int, heads: int, dtype: str, gen: torch.Generator):
    """One rank's layers in `fmt`, as the engine allocates them."""
    b, n, h, d = pages, page_size, heads, HEAD_DIM
    layers = []
    for _ in range(NUM_LAYERS):
        if fmt is KVCacheFormat.KVSTAGE:
            layers.append(_random((2, b * n, h, d), dtype, gen))
        elif fmt is KVCacheFormat.SGLANG:
            layers.append((_random((b * n, h, d), dtype, gen), _random((b * n, h, d), dtype, gen)))
        elif fmt is KVCacheFormat.VLLM_NHD:  # memory [B, N, H, 2D], handed over as the logical [B, H, N, 2D]
            layers.append(_random((b, n, h, 2 * d), dtype, gen).transpose(1, 2))
        else:  # vllm_hnd and vllm_cpu: memory [B, H, N, 2D]
            layers.append(_random((b, h, n, 2 * d), dtype, gen))
    return layers


def _reference_views(fmt: KVCacheFormat, layers, pages: int, page_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V as `[pages, page_size, heads, head_dim]` views of the engine's tensors, by the documented
    formula of each format."""
    b, n, d = pages, page_size, HEAD_DIM
    out = []
    for t in layers:
        if fmt is KVCacheFormat.KVSTAGE:
            out.append((t[0].view(b, n, *t.shape[2:]), t[1].view(b, n, *t.shape[2:])))
        elif fmt is KVCacheFormat.SGLANG:
            out.append((t[0].view(b, n, *t[0].shape[1:]), t[1].view(b, n, *t[1].shape[1:])))
        elif fmt is KVCacheFormat.VLLM_CPU:
            h = t.shape[1]
            c = t.view(b, h, 2, n * d)  # per (block, head): K transposed [D, N], then V [N, D]
            out.append((c[:, :, 0].view(b, h, d, n).permute(0, 3, 1, 2), c[:, :, 1].view(b, h, n, d).transpose(1, 2)))
        else:  # flash-attention: K and V split the last axis
            out.append((t[..., :d].transpose(1, 2), t[..., d:].transpose(1, 2)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` as integers of its own width (any strides): copies through it keep every bit."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _reference(fmt: KVCacheFormat, layers, pages: int, page_size: int) -> torch.Tensor:
    """Every byte of the layers as `[2, L, pages, page_size, heads, head_bytes]` (a copy)."""
    views = _reference_views(fmt, layers, pages, page_size)
    kv = torch.stack([torch.stack([_bits(k), _bits(v)]) for k, v in views], dim=1).contiguous()
    return kv.view(torch.uint8).reshape(*kv.shape[:-1], -1)


def _write_reference(rank: Rank, ref: torch.Tensor, num_pages: int, page_size: int) -> None:
    """Write `ref` (`[2, L, pages, page_size, heads, bytes]`) into the rank's engine tensors."""
    for layer, pair in enumerate(_reference_views(rank.fmt, rank.layers, num_pages, page_size)):
        for kv, view in enumerate(pair):
            _bits(view).copy_(ref[kv, layer].view(_bits(view).dtype))


def _slots(pages: list[int], page_size: int, start: int, end: int) -> tuple[list[int], list[int]]:
    return [pages[t // page_size] for t in range(start, end)], [t % page_size for t in range(start, end)]


@dataclass
class Rank:
    fmt: KVCacheFormat
    layers: list
    kv: EngineKV
    pages: list[int]


def _on(layer, device: str):
    """`layer` on `device`, strides kept (`Tensor.to` keeps a dense tensor's stride order)."""
    return tuple(t.to(device) for t in layer) if isinstance(layer, tuple) else layer.to(device)


def _rank(fmt, layout, tp, rank, num_pages, gen, device: str = "cpu") -> Rank:
    heads = len(heads_of_rank(layout.num_kv_heads, tp, rank))
    layers = [
        _on(layer, device) for layer in _engine_tensors(fmt, num_pages, layout.page_size, heads, layout.dtype, gen)
    ]
    pages = torch.randperm(num_pages, generator=gen).tolist()
    return Rank(fmt, layers, EngineKV.from_layers(layout, fmt, layers, heads), pages)


def _handoff(
    h,
    p,
    d,
    dtype,
    page_size,
    prefill_fmt,
    decode_fmts,
    num_tokens,
    prefix_pages,
    chunk_pages,
    seed,
    device="cpu",
    staging_device="cpu",
):
    """Stage every chunk of the room from P prefill ranks to D decode ranks; check every decode byte."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(NUM_LAYERS, h, HEAD_DIM, dtype, page_size)
    num_pages = -(-num_tokens // page_size) + 2
    prefix = min(prefix_pages * page_size, num_tokens - 1)
    prefix -= prefix % page_size
    truth = torch.randint(0, 256, (2, NUM_LAYERS, num_tokens, h, layout.head_bytes), dtype=torch.uint8, generator=gen)
    truth = truth.to(device)
    prefill = [_rank(prefill_fmt, layout, p, r, num_pages, gen, device) for r in range(p)]
    for r, rank in enumerate(prefill):  # the engine computes its heads of the true KV into its pages
        heads = heads_of_rank(h, p, r)
        ref = _reference(rank.fmt, rank.layers, num_pages, page_size)
        ref[:, :, *_slots(rank.pages, page_size, 0, num_tokens)] = truth[:, :, :, heads.start : heads.stop]
        _write_reference(rank, ref, num_pages, page_size)
    decode = [_rank(decode_fmts[r % len(decode_fmts)], layout, d, r, num_pages, gen, device) for r in range(d)]
    expected = []
    for r, rank in enumerate(decode):
        heads = heads_of_rank(h, d, r)
        want = _reference(rank.fmt, rank.layers, num_pages, page_size)
        want[:, :, *_slots(rank.pages, page_size, prefix, num_tokens)] = truth[
            :, :, prefix:, heads.start : heads.stop
        ].to(device)
        expected.append(want)
    grid = ChunkGrid(chunk_pages * page_size, page_size)
    for chunk in grid.chunks(num_tokens, prefix):
        for r, rank in enumerate(decode):
            plan = plan_staging(layout, p, d, r, chunk.num_tokens)
            offset = (0, 64, 3 * layout.itemsize)[chunk.index % 3]
            staging = torch.zeros(offset + plan.total_bytes, dtype=torch.uint8, device=staging_device)
            for block in plan.blocks:
                writer = prefill[block.prefill_rank]
                assert gather_block(writer.kv, writer.pages, chunk, block, staging, offset) == block.nbytes
            assert scatter_region(staging, offset, plan, rank.kv, rank.pages, chunk) == plan.total_bytes
    for r, rank in enumerate(decode):
        got = _reference(rank.fmt, rank.layers, num_pages, page_size)
        assert torch.equal(got, expected[r]), (rank.fmt, r)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("tp", TP_PAIRS.values(), ids=TP_PAIRS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefill_fmt", FORMATS, ids=[f.value for f in FORMATS])
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    decode_fmts=st.lists(st.sampled_from(FORMATS), min_size=1, max_size=3),
    extra_tokens=st.integers(1, 300),
    prefix_pages=st.integers(0, 3),
    chunk_pages=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_staged_handoff_between_engine_layouts_is_bit_exact(
    prefill_fmt, dtype, tp, page_size, decode_fmts, extra_tokens, prefix_pages, chunk_pages, seed
):
    h, p, d = tp
    num_tokens = min(extra_tokens, 3 * page_size + 5) + 1
    _handoff(h, p, d, dtype, page_size, prefill_fmt, decode_fmts, num_tokens, prefix_pages, chunk_pages, seed)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.value for f in FORMATS])
def test_gather_reads_the_engines_tensor_and_scatter_writes_it_in_place(fmt):
    """No intermediate pool: the views share the engine's storage, and a scatter is visible in the engine's tensor."""
    layout = KVLayout(NUM_LAYERS, 2, HEAD_DIM, "bfloat16", 16)
    gen = torch.Generator().manual_seed(5)
    layers = _engine_tensors(fmt, 4, 16, 2, "bfloat16", gen)
    kv = EngineKV.from_layers(layout, fmt, layers, 2)
    first = layers[0][0] if fmt is KVCacheFormat.SGLANG else layers[0]
    storage = first.untyped_storage().data_ptr()
    assert kv.k(0).untyped_storage().data_ptr() == storage and kv.v(0).untyped_storage().data_ptr() in {
        storage,
        layers[0][1].untyped_storage().data_ptr() if fmt is KVCacheFormat.SGLANG else storage,
    }
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    nbytes = gather(kv, [2, 0], 3, 20, 0, 2, staging, 0)
    block = staging[:nbytes].view(torch.int16).view(2, NUM_LAYERS, 17, 2, HEAD_DIM)
    before = _reference(fmt, layers, 4, 16).view(torch.int16)
    assert torch.equal(block[0, 1, 0], before[0, 1, 2, 3])  # token 3 = page 2, position 3, read from the engine
    staging[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    scatter(staging, 0, kv, [1, 3], 3, 20, 0, 2)
    after = _reference(fmt, layers, 4, 16).view(torch.int16)  # read through the engine's own tensors
    assert torch.equal(after[:, :, 1, 3:], block[:, :, :13])  # tokens 3..15: page 1, positions 3..15
    assert torch.equal(after[:, :, 3, :4], block[:, :, 13:])  # tokens 16..19: page 3, positions 0..3
    assert torch.equal(after[:, :, [0, 2]], before[:, :, [0, 2]])  # pages of nobody else's room untouched


def test_engine_pages_are_checked_for_bounds_and_distinctness_but_never_allocated():
    layout = KVLayout(1, 2, HEAD_DIM, "float16", 4)
    kv = EngineKV.from_layers(layout, KVCacheFormat.SGLANG, [(torch.zeros(16, 2, 8).half(),) * 2], 2)
    assert kv.num_pages == 4 and kv.slot_indices([3, 0], 2, 6).tolist() == [14, 15, 0, 1]
    with pytest.raises(InvalidRequest, match="outside"):
        kv.slot_indices([4], 0, 4)
    with pytest.raises(InvalidRequest, match="repeat"):
        kv.slot_indices([1, 1], 0, 8)
    assert kv.request_slots([2], 0, 4).range(1, 3).tolist() == [9, 10]


@pytest.mark.parametrize(
    ("fmt", "layer", "message"),
    [
        (KVCacheFormat.VLLM_NHD, torch.zeros(3, 2, 4, 16), r"\(head, position\) strides"),  # an HND tensor
        (KVCacheFormat.VLLM_HND, torch.zeros(3, 4, 2, 16).transpose(1, 2), r"\(head, position\) strides"),
        (KVCacheFormat.VLLM_CPU, torch.zeros(3, 2, 4, 8), "block_size, 2\\*head_dim"),
        (KVCacheFormat.SGLANG, (torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)), "whole number of pages"),
        (KVCacheFormat.KVSTAGE, torch.zeros(2, 12, 3, 8), "heads"),
        (KVCacheFormat.VLLM_HND, torch.zeros(3, 2, 4, 16, dtype=torch.float16), "float16 for a layout of float32"),
    ],
)
def test_a_tensor_that_does_not_match_its_format_is_refused_naming_what_differs(fmt, layer, message):
    with pytest.raises(ConfigError, match=message):
        EngineKV.from_layers(KVLayout(1, 2, 8, "float32", 4), fmt, [layer], 2)


def test_vllm_cpu_keys_are_copied_element_by_element_and_refuse_a_block_address_below_the_element():
    layout = KVLayout(1, 2, 8, "float32", 4)
    kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, [torch.zeros(3, 2, 4, 16)], 2)
    assert kv.max_word_bytes == 4
    with pytest.raises(InvalidRequest, match="element by element"):
        gather(kv, [0], 0, 4, 0, 2, torch.zeros(4096, dtype=torch.uint8), 2)


def test_a_kvpool_and_an_engine_view_of_its_storage_gather_the_same_bytes():
    """The KVPool fast path (one flat plane) and the per-layer engine path agree on the same memory."""
    layout = KVLayout(NUM_LAYERS, 4, HEAD_DIM, "bfloat16", 16)
    pool = KVPool(layout, 4, 6)
    pool.flat.copy_(torch.randint(0, 256, pool.flat.shape, dtype=torch.uint8))
    engine = EngineKV.from_layers(layout, KVCacheFormat.KVSTAGE, [pool.kv[:, i] for i in range(NUM_LAYERS)], 4)
    pages = pool.allocator.allocate(3)
    out = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(2)]
    for store, staging in zip((pool, engine), out, strict=True):
        gather(store, pages, 5, 40, 1, 2, staging, 0)
    assert torch.equal(out[0], out[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staging_device", ["cuda", "cpu"])
@pytest.mark.parametrize("tp", TP_PAIRS.values(), ids=TP_PAIRS.keys())
@pytest.mark.parametrize("prefill_fmt", FORMATS, ids=[f.value for f in FORMATS])
def test_staged_handoff_between_engine_layouts_on_a_gpu_is_bit_exact(prefill_fmt, tp, staging_device):
    """Engine tensors on the GPU; staging on it too, or in host memory (what the DRAM transports register)."""
    h, p, d = tp
    for dtype in DTYPES:
        for page_size in PAGE_SIZES:
            _handoff(h, p, d, dtype, page_size, prefill_fmt, FORMATS, 3 * page_size + 5, 1, 2, seed=page_size,
                     device="cuda", staging_device=staging_device)  # fmt: skip
