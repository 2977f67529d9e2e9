"""Staged copies: gather a token range of a rank's KV into a writer block, and scatter a block back into a pool.

Owns `gather` and `scatter` (one head range, one token range, any byte offset of a staging buffer), their
plan-driven forms `gather_block` / `scatter_block` / `scatter_region` (and `scatter_region_slots`, for slots a caller
looked up once per request), and `StagingBuffer`, the byte buffer that a decode rank's `StagingRing` hands out
regions of.

Block layout (see docs/layout.md): `[K layer 0..L-1 | V layer 0..L-1]`, each layer token-major
`tokens x heads x head_dim`, i.e. a contiguous `[2, L, tokens, heads, head_dim]` array.

Host staging: the staging buffer may sit in host memory while the pool is on a GPU (what the DRAM transports
register). Gather then selects on the GPU and copies the block down once; scatter copies it up once and selects
on the GPU. Both return only when the bytes have landed, so the caller may free or reuse the region at once.

Invariants: copies go through an integer view of the bytes (the widest word that divides the head size and the
block's address), so every bit pattern survives, NaN payloads and -0.0 included, in fp32, bf16, fp16 and fp8.
Each copy is a single torch op over all layers and both K and V (`index_select` / `index_copy_` over slot
indices): no Python loop per token, page or layer; the same code runs on CPU and CUDA. (A fused Triton kernel
was measured on an H200 and was slower than `index_select`; see docs/benchmarks.md.) Bounds are checked
before anything is written.

Called by the prefill agent (gather into local staging before the bulk write), the decode agent (scatter after
every writer of a chunk arrived), the simulator, the demo and the benchmarks.
"""

from __future__ import annotations

import torch

from kvstage.dataplane.pool import WORD_DTYPES, KVPool, Pages
from kvstage.errors import InvalidRequest
from kvstage.layout import Chunk, StagingPlan, WriterBlock


class StagingBuffer:
    """A contiguous byte buffer on one device; the bytes behind a `StagingRing`'s offsets."""

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu") -> None:
        if capacity_bytes <= 0:
            raise InvalidRequest(f"staging capacity must be positive, got {capacity_bytes}")
        self.flat = torch.zeros(capacity_bytes, dtype=torch.uint8, device=torch.device(device))

    @property
    def capacity_bytes(self) -> int:
        return self.flat.numel()


def block_bytes(pool: KVPool, num_tokens: int, num_heads: int) -> int:
    """Bytes of one writer block of `num_tokens` tokens and `num_heads` heads of `pool`'s layout."""
    return 2 * pool.layout.num_layers * num_tokens * num_heads * pool.layout.head_bytes


def _region(staging: torch.Tensor, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
    if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
        raise InvalidRequest(
            f"staging must be a contiguous 1-D uint8 tensor, got {staging.dtype} of shape {tuple(staging.shape)}"
        )
    if staging.device != device and staging.device.type != "cpu":
        raise InvalidRequest(f"staging is on {staging.device} but the KV pool is on {device}")
    if offset < 0 or offset + nbytes > staging.numel():
        raise InvalidRequest(
            f"staging block [{offset}, {offset + nbytes}) does not fit a staging buffer of {staging.numel()} bytes"
        )
    return staging[offset : offset + nbytes]


def _word_bytes(head_bytes: int, region: torch.Tensor) -> int:
    """Widest integer word that divides the head size and the region's address."""
    return next(w for w in (8, 4, 2, 1) if head_bytes % w == 0 and region.data_ptr() % w == 0)


def _views(
    pool: KVPool, staging: torch.Tensor, offset: int, num_tokens: int, head_start: int, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool head slice `[2, L, slots, heads, words]`, block `[2, L, tokens, heads, words]`), same word dtype.

    Checks that the block fits the staging buffer before anything is copied.
    """
    region = _region(staging, offset, block_bytes(pool, num_tokens, num_heads), pool.device)
    word = _word_bytes(pool.layout.head_bytes, region)
    heads = pool.words(word)[:, :, :, head_start : head_start + num_heads]
    shape = (2, pool.layout.num_layers, num_tokens, num_heads, pool.layout.head_bytes // word)
    return heads, region.view(WORD_DTYPES[word]).view(shape)


def gather(
    pool: KVPool,
    pages: Pages,
    token_start: int,
    token_end: int,
    head_start: int,
    num_heads: int,
    staging: torch.Tensor,
    offset: int,
) -> int:
    """Copy tokens `[token_start, token_end)` of local heads `[head_start, +num_heads)` into a block at `offset`.

    `pages` are the request's page ids in token order. Returns the bytes written.
    """
    pool.geometry.check_heads(head_start, num_heads)
    return gather_slots(pool, pool.slot_indices(pages, token_start, token_end), head_start, num_heads, staging, offset)


def gather_slots(
    pool: KVPool,
    slots: torch.Tensor,
    head_start: int,
    num_heads: int,
    staging: torch.Tensor,
    offset: int,
) -> int:
    """`gather` for slots already returned by `pool.slot_indices`: one kernel, no page validation.

    For hot paths that validate a request's pages once and reuse its slot indices for every chunk.
    """
    src, block = _views(pool, staging, offset, slots.numel(), head_start, num_heads)
    if block.device == src.device:
        torch.index_select(src, 2, slots, out=block)
    else:  # host staging of a device pool: gather on the device, one copy down (returns once it has landed)
        block.copy_(torch.index_select(src, 2, slots))
    return block.numel() * block.element_size()


def scatter(
    staging: torch.Tensor,
    offset: int,
    pool: KVPool,
    pages: Pages,
    token_start: int,
    token_end: int,
    head_start: int,
    num_heads: int,
) -> int:
    """Copy the block at `offset` into tokens `[token_start, token_end)` of local heads `[head_start, +num_heads)`.

    The inverse of `gather`. Returns the bytes read.
    """
    pool.geometry.check_heads(head_start, num_heads)
    return scatter_slots(staging, offset, pool, pool.slot_indices(pages, token_start, token_end), head_start, num_heads)


def scatter_slots(
    staging: torch.Tensor,
    offset: int,
    pool: KVPool,
    slots: torch.Tensor,
    head_start: int,
    num_heads: int,
) -> int:
    """`scatter` for slots already returned by `pool.slot_indices`: one kernel, no page validation."""
    nbytes = _queue_scatter(staging, offset, pool, slots, head_start, num_heads)
    _wait_landed(pool)
    return nbytes


def _queue_scatter(
    staging: torch.Tensor, offset: int, pool: KVPool, slots: torch.Tensor, head_start: int, num_heads: int
) -> int:
    """Queue one block's scatter on the current stream; the caller waits with `_wait_landed` before the staging
    bytes may change. Host staging of a device pool: one copy up (not waited for), then the scatter kernel."""
    dst, block = _views(pool, staging, offset, slots.numel(), head_start, num_heads)
    dst.index_copy_(2, slots, block.to(dst.device, non_blocking=True))
    return block.numel() * block.element_size()


def _wait_landed(pool: KVPool) -> None:
    """Return once every queued scatter into `pool` has landed, whichever stream reads the pool next, and the
    staging bytes they read may be reused."""
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()


def _check_block(pool: KVPool, block: WriterBlock, num_tokens: int) -> None:
    expected = num_tokens * block.transfer.num_heads * pool.layout.head_bytes
    if block.layer_bytes != expected:
        raise InvalidRequest(
            f"writer block of {block.layer_bytes} bytes per layer was planned for another chunk size or layout; "
            f"a chunk of {num_tokens} tokens needs {expected}"
        )


def gather_block(
    pool: KVPool, pages: Pages, chunk: Chunk, block: WriterBlock, staging: torch.Tensor, region_offset: int
) -> int:
    """Prefill side: gather `chunk` into `block` of the chunk's region, which starts at `region_offset`."""
    _check_block(pool, block, chunk.num_tokens)
    transfer = block.transfer
    return gather(
        pool,
        pages,
        chunk.start,
        chunk.end,
        transfer.src_head_start,
        transfer.num_heads,
        staging,
        region_offset + block.offset,
    )


def scatter_block(
    staging: torch.Tensor, region_offset: int, block: WriterBlock, pool: KVPool, pages: Pages, chunk: Chunk
) -> int:
    """Decode side: scatter `block` of the region at `region_offset` into `chunk`'s tokens of `pool`."""
    _check_block(pool, block, chunk.num_tokens)
    transfer = block.transfer
    return scatter(
        staging,
        region_offset + block.offset,
        pool,
        pages,
        chunk.start,
        chunk.end,
        transfer.dst_head_start,
        transfer.num_heads,
    )


def scatter_region(
    staging: torch.Tensor, region_offset: int, plan: StagingPlan, pool: KVPool, pages: Pages, chunk: Chunk
) -> int:
    """Decode side: scatter every writer block of one chunk's region into `chunk`'s tokens of `pages`; one copy
    per writer, then one wait for all of them. Returns bytes read.

    Every block is checked before the first one is copied, so a bad plan writes nothing.
    """
    if plan.num_tokens != chunk.num_tokens:
        raise InvalidRequest(
            f"plan for {plan.num_tokens} tokens does not match chunk {chunk.index} of {chunk.num_tokens} tokens"
        )
    return scatter_region_slots(staging, region_offset, plan, pool, pool.slot_indices(pages, chunk.start, chunk.end))


def scatter_region_slots(
    staging: torch.Tensor, region_offset: int, plan: StagingPlan, pool: KVPool, slots: torch.Tensor
) -> int:
    """`scatter_region` into `slots` (from `KVPool.request_slots(...).range`, one per token of the plan)."""
    if plan.num_tokens != slots.numel():
        raise InvalidRequest(f"plan for {plan.num_tokens} tokens cannot scatter into {slots.numel()} slots")
    _check_region(staging, region_offset, plan, pool)
    nbytes = sum(
        _queue_scatter(staging, region_offset + b.offset, pool, slots, b.transfer.dst_head_start, b.transfer.num_heads)
        for b in plan.blocks
    )
    _wait_landed(pool)  # one wait for the whole region
    return nbytes


def _check_region(staging: torch.Tensor, region_offset: int, plan: StagingPlan, pool: KVPool) -> None:
    """Every block of `plan` fits `pool` and the region fits `staging`."""
    if plan.layout != pool.layout:
        raise InvalidRequest(f"plan for {plan.layout} does not match a pool of {pool.layout}")
    for block in plan.blocks:
        _check_block(pool, block, plan.num_tokens)
        pool.geometry.check_heads(block.transfer.dst_head_start, block.transfer.num_heads)
    _region(staging, region_offset, plan.total_bytes, pool.device)
