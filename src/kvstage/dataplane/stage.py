"""Staged copies: gather a token range of a rank's KV into a writer block, and scatter a block back into it.

Owns `gather` and `scatter` (one head range, one token range, any byte offset of a staging buffer), their
plan-driven forms `gather_block` / `scatter_block` / `scatter_region` (and `scatter_region_slots`, for slots a caller
looked up once per request), and `StagingBuffer`, the byte buffer that a decode rank's `StagingRing` hands out
regions of.

Block layout (see docs/layout.md): `[K layer 0..L-1 | V layer 0..L-1]`, each layer token-major
`tokens x heads x head_dim`, i.e. a contiguous `[2, L, tokens, heads, head_dim]` array.

Staging on the KV's GPU (a backend with device memory, `DataTransport.staging_device`): gather and scatter queue
their kernels on the current stream and return at once; the caller records a `CopyFence` after them and frees or
reuses the region once it is done (the copy thread and the decode agent do). Host staging: the staging buffer sits
in host memory while the KV is on a GPU (what the DRAM transports register). Gather then selects on the GPU and
copies the block down once, returning once it has landed; scatter copies it up once and selects on the GPU,
queued like the device case. `scatter_slots` and `scatter_region_slots` wait for their own fence before they
return (one event, never the whole stream); `queue_scatter_region` does not.

KV stores: a kvstage `KVPool` or an engine's own KV (`EngineKV`, read and written in place). Both hand out
`Plane`s, slot-addressed integer views: a `KVPool` is one plane over every layer and both K and V, so each copy
is a single torch op (`index_select` / `index_copy_` over slot indices); an `EngineKV` has one plane per (K/V,
layer), flat where its pages and positions merge into one slot axis (vLLM NHD, sglang) and indexed by (page,
position) where they cannot (vLLM CPU on a GPU, vLLM HND). No Python loop per token or page. vLLM CPU's KV in host
memory is the exception: its K is stored transposed, so a plane copies it one element per index; it is copied by
`EngineKV.tiles` (dataplane/tiles.py) instead, a few strided copies per run of one block's positions, every
layer at once. With the KV and the staging on one GPU, the Triton kernels of dataplane/kernels.py copy instead (one
launch over every layer and K and V, any of these layouts but vLLM CPU's transposed K; imported only then); this
torch path is their bit-exact reference and serves the CPU and host staging (docs/benchmarks.md has both measured
on an H200, and the vLLM CPU path on a CPU).

Invariants: copies go through an integer view of the bytes (the widest word that divides the head size, the
block's address and the store's strides), so every bit pattern survives, NaN payloads and -0.0 included, in fp32,
bf16, fp16 and fp8. Bounds are checked before anything is written.

Called by the prefill agent (gather into local staging before the bulk write), the decode agent (scatter after
every writer of a chunk arrived), the simulator, the demo and the benchmarks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstage.dataplane.engine_kv import EngineKV, KVStore
from kvstage.dataplane.fence import CopyFence
from kvstage.dataplane.pool import WORD_DTYPES, Pages, Plane
from kvstage.errors import InvalidRequest
from kvstage.layout import Chunk, StagingPlan, WriterBlock

if TYPE_CHECKING:
    from kvstage.dataplane.kernels import KVAddress
    from kvstage.dataplane.tiles import Tiles


class StagingBuffer:
    """A contiguous byte buffer on one device; the bytes behind a `StagingRing`'s offsets."""

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu") -> None:
        if capacity_bytes <= 0:
            raise InvalidRequest(f"staging capacity must be positive, got {capacity_bytes}")
        self.flat = torch.zeros(capacity_bytes, dtype=torch.uint8, device=torch.device(device))

    @property
    def capacity_bytes(self) -> int:
        return self.flat.numel()


def block_bytes(kv: KVStore, num_tokens: int, num_heads: int) -> int:
    """Bytes of one writer block of `num_tokens` tokens and `num_heads` heads of `kv`'s layout."""
    return 2 * kv.layout.num_layers * num_tokens * num_heads * kv.layout.head_bytes


def _region(staging: torch.Tensor, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
    if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
        raise InvalidRequest(
            f"staging must be a contiguous 1-D uint8 tensor, got {staging.dtype} of shape {tuple(staging.shape)}"
        )
    if staging.device != device and staging.device.type != "cpu":
        raise InvalidRequest(f"staging is on {staging.device} but the KV is on {device}")
    if offset < 0 or offset + nbytes > staging.numel():
        raise InvalidRequest(
            f"staging block [{offset}, {offset + nbytes}) does not fit a staging buffer of {staging.numel()} bytes"
        )
    return staging[offset : offset + nbytes]


def _word_bytes(kv: KVStore, region: torch.Tensor) -> int:
    """Widest integer word that divides the head size, the region's address and the store's own alignment."""
    return next(
        w
        for w in (8, 4, 2, 1)
        if w <= kv.max_word_bytes and kv.layout.head_bytes % w == 0 and region.data_ptr() % w == 0
    )


def _block(kv: KVStore, staging: torch.Tensor, offset: int, num_tokens: int, num_heads: int) -> torch.Tensor:
    """The block `[2, L, tokens, heads, words]` at `offset` of `staging`, in the widest word that `_word_bytes`
    allows. Checks that it fits the staging buffer before anything is copied."""
    region = _region(staging, offset, block_bytes(kv, num_tokens, num_heads), kv.device)
    word = _word_bytes(kv, region)
    shape = (2, kv.layout.num_layers, num_tokens, num_heads, kv.layout.head_bytes // word)
    return region.view(WORD_DTYPES[word]).view(shape)


class _Rows:
    """Where a copy's tokens are in a plane: the slots, and for paged planes their (page, position) pairs."""

    def __init__(self, slots: torch.Tensor, page_size: int, planes: tuple[Plane, ...]) -> None:
        self.slots = slots
        self.paged = (slots // page_size, slots % page_size) if any(p.paged for p in planes) else None

    def take(self, plane: Plane, heads: slice, out: torch.Tensor) -> None:
        """Copy this copy's tokens of `heads` of `plane` into `out` `[..., tokens, heads, words]`."""
        src = plane.words[..., heads, :]
        if self.paged is None or not plane.paged:
            torch.index_select(src, plane.axis, self.slots, out=out)
        else:
            out.copy_(src[self.paged])

    def put(self, plane: Plane, heads: slice, block: torch.Tensor) -> None:
        """Copy `block` `[..., tokens, heads, words]` into this copy's tokens of `heads` of `plane`, in place."""
        dst = plane.words[..., heads, :]
        if self.paged is None or not plane.paged:
            dst.index_copy_(plane.axis, self.slots, block)
        else:
            dst.index_put_(self.paged, block)


def gather(
    kv: KVStore,
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
    kv.geometry.check_heads(head_start, num_heads)
    return gather_slots(kv, kv.slot_indices(pages, token_start, token_end), head_start, num_heads, staging, offset)


def gather_slots(
    kv: KVStore,
    slots: torch.Tensor,
    head_start: int,
    num_heads: int,
    staging: torch.Tensor,
    offset: int,
) -> int:
    """`gather` for slots already returned by `kv.slot_indices`: one copy per plane, no page validation.

    For hot paths that validate a request's pages once and reuse its slot indices for every chunk.
    """
    if (address := _kernel_address(kv, staging)) is not None:
        return address.gather(slots, head_start, num_heads, staging, offset)
    block, heads = _block(kv, staging, offset, slots.numel(), num_heads), slice(head_start, head_start + num_heads)
    if (tiles := _tiles(kv)) is not None:
        tiles.gather(slots, heads, block)
        return block.numel() * block.element_size()
    planes = kv.planes(block.element_size())
    # host staging of a device store: gather on the device, one copy down (returns once it has landed)
    out = block if block.device == kv.device else torch.empty(block.shape, dtype=block.dtype, device=kv.device)
    rows = _Rows(slots, kv.layout.page_size, planes)
    for plane in planes:
        rows.take(plane, heads, out[plane.part])
    if out is not block:
        block.copy_(out)
    return block.numel() * block.element_size()


def scatter(
    staging: torch.Tensor,
    offset: int,
    kv: KVStore,
    pages: Pages,
    token_start: int,
    token_end: int,
    head_start: int,
    num_heads: int,
) -> int:
    """Copy the block at `offset` into tokens `[token_start, token_end)` of local heads `[head_start, +num_heads)`.

    The inverse of `gather`. Returns the bytes read.
    """
    kv.geometry.check_heads(head_start, num_heads)
    return scatter_slots(staging, offset, kv, kv.slot_indices(pages, token_start, token_end), head_start, num_heads)


def scatter_slots(
    staging: torch.Tensor,
    offset: int,
    kv: KVStore,
    slots: torch.Tensor,
    head_start: int,
    num_heads: int,
) -> int:
    """`scatter` for slots already returned by `kv.slot_indices`: one copy per plane, no page validation."""
    nbytes = _queue_scatter(staging, offset, kv, slots, head_start, num_heads)
    CopyFence.record(kv.device).wait()
    return nbytes


def _queue_scatter(
    staging: torch.Tensor, offset: int, kv: KVStore, slots: torch.Tensor, head_start: int, num_heads: int
) -> int:
    """Queue one block's scatter on the current stream; the caller waits for a `CopyFence` recorded after it before
    the staging bytes may change. Host staging of a device store: one copy up (not waited for), then the scatter
    kernels."""
    if (address := _kernel_address(kv, staging)) is not None:
        return address.scatter(staging, offset, slots, head_start, num_heads)
    block, heads = _block(kv, staging, offset, slots.numel(), num_heads), slice(head_start, head_start + num_heads)
    if (tiles := _tiles(kv)) is not None:
        tiles.scatter(block, slots, heads)
        return block.numel() * block.element_size()
    planes = kv.planes(block.element_size())
    src = block.to(kv.device, non_blocking=True)
    rows = _Rows(slots, kv.layout.page_size, planes)
    for plane in planes:
        rows.put(plane, heads, src[plane.part])
    return block.numel() * block.element_size()


def _tiles(kv: KVStore) -> Tiles | None:
    """How vLLM CPU's KV in host memory is copied, run by run; None: another store, through its planes."""
    return kv.tiles if isinstance(kv, EngineKV) else None


def _kernel_address(kv: KVStore, staging: torch.Tensor) -> KVAddress | None:
    """Where the Triton kernels copy: KV and staging on one GPU, in a layout they serve; None: the torch path."""
    if kv.device.type != "cuda" or staging.device != kv.device:
        return None
    from kvstage.dataplane.kernels import address_of  # Triton: imported only for CUDA

    return address_of(kv)


def _check_block(kv: KVStore, block: WriterBlock, num_tokens: int) -> None:
    expected = num_tokens * block.transfer.num_heads * kv.layout.head_bytes
    if block.layer_bytes != expected:
        raise InvalidRequest(
            f"writer block of {block.layer_bytes} bytes per layer was planned for another chunk size or layout; "
            f"a chunk of {num_tokens} tokens needs {expected}"
        )


def gather_block(
    kv: KVStore, pages: Pages, chunk: Chunk, block: WriterBlock, staging: torch.Tensor, region_offset: int
) -> int:
    """Prefill side: gather `chunk` into `block` of the chunk's region, which starts at `region_offset`."""
    _check_block(kv, block, chunk.num_tokens)
    transfer = block.transfer
    return gather(
        kv,
        pages,
        chunk.start,
        chunk.end,
        transfer.src_head_start,
        transfer.num_heads,
        staging,
        region_offset + block.offset,
    )


def scatter_block(
    staging: torch.Tensor, region_offset: int, block: WriterBlock, kv: KVStore, pages: Pages, chunk: Chunk
) -> int:
    """Decode side: scatter `block` of the region at `region_offset` into `chunk`'s tokens of `kv`."""
    _check_block(kv, block, chunk.num_tokens)
    transfer = block.transfer
    return scatter(
        staging,
        region_offset + block.offset,
        kv,
        pages,
        chunk.start,
        chunk.end,
        transfer.dst_head_start,
        transfer.num_heads,
    )


def scatter_region(
    staging: torch.Tensor, region_offset: int, plan: StagingPlan, kv: KVStore, pages: Pages, chunk: Chunk
) -> int:
    """Decode side: scatter every writer block of one chunk's region into `chunk`'s tokens of `pages`; one copy
    per writer, then one wait for all of them. Returns bytes read.

    Every block is checked before the first one is copied, so a bad plan writes nothing.
    """
    if plan.num_tokens != chunk.num_tokens:
        raise InvalidRequest(
            f"plan for {plan.num_tokens} tokens does not match chunk {chunk.index} of {chunk.num_tokens} tokens"
        )
    return scatter_region_slots(staging, region_offset, plan, kv, kv.slot_indices(pages, chunk.start, chunk.end))


def scatter_region_slots(
    staging: torch.Tensor, region_offset: int, plan: StagingPlan, kv: KVStore, slots: torch.Tensor
) -> int:
    """`scatter_region` into `slots` (from `kv.request_slots(...).range`, one per token of the plan)."""
    nbytes = queue_scatter_region(staging, region_offset, plan, kv, slots)
    CopyFence.record(kv.device).wait()  # one wait for the whole region
    return nbytes


def queue_scatter_region(
    staging: torch.Tensor, region_offset: int, plan: StagingPlan, kv: KVStore, slots: torch.Tensor
) -> int:
    """`scatter_region_slots` without the wait: the copies are queued on the current stream; the region's bytes may
    change only once a `CopyFence` recorded after them is done. Every block is checked before the first is queued."""
    if plan.num_tokens != slots.numel():
        raise InvalidRequest(f"plan for {plan.num_tokens} tokens cannot scatter into {slots.numel()} slots")
    _check_region(staging, region_offset, plan, kv)
    address = _kernel_address(kv, staging)
    if address is not None and _adjacent(plan):  # fan-in: the writers' blocks in one launch, whole slot rows
        first = plan.blocks[0].transfer
        heads, blocks = first.num_heads, len(plan.blocks)
        return address.scatter_blocks(staging, region_offset, slots, first.dst_head_start, heads, blocks)
    return sum(
        _queue_scatter(staging, region_offset + b.offset, kv, slots, b.transfer.dst_head_start, b.transfer.num_heads)
        for b in plan.blocks
    )


def _adjacent(plan: StagingPlan) -> bool:
    """Whether the plan's blocks are back to back from offset 0, of one head count, holding consecutive heads."""
    first = plan.blocks[0]
    heads, nbytes = first.transfer.num_heads, first.nbytes
    return len(plan.blocks) > 1 and all(
        b.offset == i * nbytes
        and b.nbytes == nbytes
        and b.transfer.num_heads == heads
        and b.transfer.dst_head_start == first.transfer.dst_head_start + i * heads
        for i, b in enumerate(plan.blocks)
    )


def _check_region(staging: torch.Tensor, region_offset: int, plan: StagingPlan, kv: KVStore) -> None:
    """Every block of `plan` fits `kv` and the region fits `staging`."""
    if plan.layout != kv.layout:
        raise InvalidRequest(f"plan for {plan.layout} does not match KV of {kv.layout}")
    for block in plan.blocks:
        _check_block(kv, block, plan.num_tokens)
        kv.geometry.check_heads(block.transfer.dst_head_start, block.transfer.num_heads)
    _region(staging, region_offset, plan.total_bytes, kv.device)
