"""Triton gather/scatter between paged KV in GPU memory and a staging block: one launch per call.

Owns `KVAddress` (where one rank's K and V pages lie: a base tensor, a byte offset per (K|V, layer) and the byte
strides of page, position in page and head, so a contiguous `KVPool` and an engine's own per-layer 4-D views
`[pages, page_size, heads, head_dim]` of any stride order are served alike) with its copies, `gather` (KV ->
block), `scatter` (block -> KV) and `scatter_blocks` (several writers' blocks of one staging region, adjacent in
the region and in the heads, in one launch, so every program writes whole slot rows of those heads); `address_of`
(a store's address, built once) and `LaunchConfig`.

Block layout as in dataplane.stage: `[K layer 0..L-1 | V layer 0..L-1]`, each layer `tokens x heads x head bytes`.
One program copies `block_tokens` tokens of one (K|V, layer): a `[tokens, heads, head bytes]` tile, read and written
as bytes, so every bit pattern survives (NaN payloads, -0.0, fp8), and Triton can issue 16-byte vector loads where the
strides and addresses allow it (Triton specialises on their divisibility by 16).

Invariants: the caller's slots come from a validated lookup (`KVPool.request_slots`, or pages the engine vouches
for); a slot outside the KV is masked off, so no byte outside the KV or the block is ever read or written. Head
range, slot tensor and staging region are checked before the launch. The copy is queued on the current stream and
not waited for: the caller orders or waits (dataplane.stage waits after a scatter, as its torch path does).

Imported lazily by dataplane.stage only when the KV and the staging are on the same CUDA device; the CPU, and host
staging of a GPU pool, keep the torch path in stage.py, which is the reference these kernels are tested against.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]

from kvstage.dataplane.engine_kv import KVStore
from kvstage.dataplane.pool import KVPool
from kvstage.errors import InvalidRequest
from kvstage.layout import ceil_div

#: Bytes one program copies by default, and its warps (tuned on an H200: docs/benchmarks.md).
TILE_BYTES = 16384
NUM_WARPS = 8


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tokens per program and warps per program of one launch."""

    block_tokens: int
    num_warps: int


@dataclass(frozen=True, slots=True, eq=False)
class KVAddress:
    """One rank's paged K and V: `2 * num_layers` layers (K of layer 0..L-1, then V), each addressed as
    `base + layer offset + page * page_stride + position * pos_stride + head * head_stride + byte` (all in bytes).

    Layer offsets are `layer_first + i * layer_stride` when `layer_table` is None, else `layer_table[i] * table_align`
    (int64 on the device, for engines whose per-layer tensors are separate allocations).
    """

    base: torch.Tensor  # uint8 on the device; only its address is used
    num_views: int
    layer_first: int
    layer_stride: int
    layer_table: torch.Tensor | None
    table_align: int
    num_pages: int
    page_size: int
    num_heads: int
    head_bytes: int
    page_stride: int
    pos_stride: int
    head_stride: int
    spec: tuple[object, ...] = field(init=False, repr=False)  # what a compiled kernel depends on, of the above

    def __post_init__(self) -> None:
        table = self.base if self.layer_table is None else self.layer_table
        ints = (self.num_slots, self.layer_first, self.layer_stride, self.page_stride, self.pos_stride)
        spec = (self.device, self.page_size, self.head_bytes, self.table_align, *map(_int_spec, ints))
        object.__setattr__(
            self, "spec", (*spec, _int_spec(self.head_stride), _pointer_spec(self.base), _pointer_spec(table))
        )

    def gather(
        self,
        slots: torch.Tensor,
        head_start: int,
        num_heads: int,
        staging: torch.Tensor,
        offset: int,
        config: LaunchConfig | None = None,
    ) -> int:
        """Queue the copy of `slots`' tokens of heads `[head_start, +num_heads)` into the block at byte `offset` of
        `staging`, all layers and K and V in one launch. Returns the block's bytes."""
        return _launch(self, slots, head_start, num_heads, staging, offset, config, gather=True, blocks=1)

    def scatter(
        self,
        staging: torch.Tensor,
        offset: int,
        slots: torch.Tensor,
        head_start: int,
        num_heads: int,
        config: LaunchConfig | None = None,
    ) -> int:
        """Queue the copy of the block at byte `offset` of `staging` into `slots`' tokens of heads
        `[head_start, +num_heads)`: the inverse of `gather`. Returns the block's bytes."""
        return _launch(self, slots, head_start, num_heads, staging, offset, config, gather=False, blocks=1)

    def scatter_blocks(
        self,
        staging: torch.Tensor,
        offset: int,
        slots: torch.Tensor,
        head_start: int,
        heads_per_block: int,
        blocks: int,
        config: LaunchConfig | None = None,
    ) -> int:
        """`scatter` of `blocks` blocks that lie back to back from byte `offset`, block b holding heads
        `[head_start + b * heads_per_block, +heads_per_block)`, in one launch: each program writes whole rows of
        `blocks * heads_per_block` heads (a fan-in region's writers, P > D). Returns the blocks' bytes."""
        return _launch(self, slots, head_start, heads_per_block, staging, offset, config, gather=False, blocks=blocks)

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def of_pool(cls, pool: KVPool) -> KVAddress:
        """A `KVPool`'s storage, `[2, L, slots, heads, head_dim]` row-major: pure arithmetic, no device work."""
        geometry = pool.geometry
        slot_bytes = geometry.slot_bytes
        return cls(
            base=pool.flat,
            num_views=2 * pool.layout.num_layers,
            layer_first=0,
            layer_stride=geometry.layer_bytes,
            layer_table=None,
            table_align=1,
            num_pages=geometry.num_pages,
            page_size=pool.layout.page_size,
            num_heads=geometry.num_heads,
            head_bytes=pool.layout.head_bytes,
            page_stride=pool.layout.page_size * slot_bytes,
            pos_stride=slot_bytes,
            head_stride=pool.layout.head_bytes,
        )

    @classmethod
    def of_views(cls, views: Sequence[torch.Tensor]) -> KVAddress:
        """Per-layer views `[pages, page_size, heads, head_dim]`, K of every layer then V of every layer, all of one
        shape, strides, dtype and device, each head's `head_dim` contiguous. Build once per KV cache: a layer table
        costs one copy to the device."""
        first = views[0]
        if len(views) % 2 or first.dim() != 4 or first.stride(3) != 1:
            raise InvalidRequest(
                f"expected K and V views [pages, page_size, heads, head_dim] with a contiguous head_dim, got "
                f"{len(views)} views of shape {tuple(first.shape)}, strides {first.stride()}"
            )
        for view in views:
            if (view.shape, view.stride(), view.dtype, view.device) != (
                first.shape,
                first.stride(),
                first.dtype,
                first.device,
            ):
                raise InvalidRequest(
                    f"every K/V view must match the first ({tuple(first.shape)}, {first.stride()}, {first.dtype}); "
                    f"got {tuple(view.shape)}, {view.stride()}, {view.dtype} on {view.device}"
                )
        size = first.element_size()
        base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
        offsets = [view.data_ptr() - base.data_ptr() for view in views]
        step = offsets[1] - offsets[0]
        uniform = all(offset == offsets[0] + i * step for i, offset in enumerate(offsets))
        align = 16 if all(offset % 16 == 0 for offset in offsets) else 1
        table = None if uniform else torch.tensor([o // align for o in offsets], dtype=torch.int64).to(first.device)
        pages, page_size, heads, head_dim = first.shape
        return cls(
            base=base,
            num_views=len(views),
            layer_first=offsets[0],
            layer_stride=step,
            layer_table=table,
            table_align=align,
            num_pages=pages,
            page_size=page_size,
            num_heads=heads,
            head_bytes=head_dim * size,
            page_stride=first.stride(0) * size,
            pos_stride=first.stride(1) * size,
            head_stride=first.stride(2) * size,
        )


#: `KVAddress` of each live KV store (None: one the kernels do not serve), built on its first copy (an engine's
#: layer table is one copy to the device); an entry goes with its store.
_ADDRESSES: weakref.WeakKeyDictionary[KVStore, KVAddress | None] = weakref.WeakKeyDictionary()


def address_of(kv: KVStore) -> KVAddress | None:
    """Where `kv`'s pages lie, built once per store; None where a head's bytes are not contiguous (vLLM CPU's K,
    stored transposed): the torch path copies those."""
    if kv in _ADDRESSES:
        return _ADDRESSES[kv]
    if isinstance(kv, KVPool):
        address: KVAddress | None = KVAddress.of_pool(kv)
    else:
        layers = range(kv.layout.num_layers)
        views = [*map(kv.k, layers), *map(kv.v, layers)]
        address = KVAddress.of_views(views) if all(view.stride(3) == 1 for view in views) else None
    _ADDRESSES[kv] = address
    return address


def default_config(
    kv: KVAddress, num_heads: int, tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS
) -> LaunchConfig:
    """About `tile_bytes` per program: whole head rows of a power-of-two count of tokens."""
    row = triton.next_power_of_2(num_heads) * triton.next_power_of_2(kv.head_bytes)
    return LaunchConfig(block_tokens=max(1, tile_bytes // row), num_warps=num_warps)


def _launch(
    kv: KVAddress,
    slots: torch.Tensor,
    head_start: int,
    num_heads: int,
    staging: torch.Tensor,
    offset: int,
    config: LaunchConfig | None,
    *,
    gather: bool,
    blocks: int,
) -> int:
    num_tokens = slots.numel()
    block_bytes = kv.num_views * num_tokens * num_heads * kv.head_bytes
    _check(kv, slots, head_start, blocks * num_heads, staging, offset, blocks * block_bytes)
    if not num_tokens:
        return 0
    dynamic = (_pointer_spec(slots), _pointer_spec(staging), _int_spec(offset), _int_spec(num_tokens))
    key = (kv.spec, num_heads, blocks, head_start, gather, config, *dynamic, _int_spec(block_bytes))
    table = kv.base if kv.layer_table is None else kv.layer_table
    args = (
        *(kv.base, table, slots, staging, offset, num_tokens, kv.num_slots),
        *(kv.layer_first, kv.layer_stride, kv.page_stride, kv.pos_stride, kv.head_stride, head_start, block_bytes),
    )
    if kv.device.type == "cuda" and kv.device.index != torch.cuda.current_device():
        with torch.cuda.device(kv.device):  # Triton launches on the current device
            _run(key, kv, args, num_heads, blocks, config, gather)
    else:
        _run(key, kv, args, num_heads, blocks, config, gather)
    return blocks * block_bytes


#: Compiled kernels (and their launch grid's block and constexprs) by everything Triton specialises a launch on:
#: device, constexprs and warps, each pointer's dtype and divisibility by 16, each int's divisibility by 16, being
#: 1 and being 32-bit. A repeated launch skips Triton's per-call dispatch: 23 us of host time per call against 37.5
#: on the H200 host (docs/benchmarks.md). Bounded: a few entries per KV, head range and launch configuration.
_COMPILED: dict[tuple[object, ...], tuple[Any, int, tuple[object, ...]]] = {}
_CONSTEXPRS = (
    "PAGE_SIZE", "NUM_HEADS", "HEAD_BYTES", "HEADS_P2", "BYTES_P2", "BLOCK_T", "TABLE_ALIGN", "GATHER", "BLOCKS",
)  # fmt: skip


def _run(
    key: tuple[object, ...],
    kv: KVAddress,
    args: tuple[Any, ...],
    num_heads: int,
    blocks: int,
    config: LaunchConfig | None,
    gather: bool,
) -> None:
    entry = _COMPILED.get(key)
    if entry is None:
        config = config or default_config(kv, blocks * num_heads)
        constexprs: tuple[object, ...] = (
            *(kv.page_size, num_heads, kv.head_bytes, triton.next_power_of_2(blocks * num_heads)),
            *(triton.next_power_of_2(kv.head_bytes), config.block_tokens),
            *(0 if kv.layer_table is None else kv.table_align, gather, blocks),
        )
        grid = (triton.cdiv(args[5], config.block_tokens), kv.num_views, 1)
        params = dict(zip(_CONSTEXPRS, constexprs, strict=True))
        compiled = _copy_kernel[grid](*args, **params, num_warps=config.num_warps)
        if compiled is not None:  # Triton's CPU interpreter (TRITON_INTERPRET=1) compiles nothing
            _COMPILED[key] = (compiled, config.block_tokens, constexprs)
    else:
        compiled, block_tokens, constexprs = entry
        compiled[(ceil_div(args[5], block_tokens), kv.num_views, 1)](*args, *constexprs)


def _pointer_spec(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.dtype, tensor.data_ptr() % 16 == 0)


def _int_spec(value: int) -> tuple[bool, ...]:
    return (value % 16 == 0, value == 1, -(2**31) <= value < 2**31)


def _check(
    kv: KVAddress, slots: torch.Tensor, head_start: int, num_heads: int, staging: torch.Tensor, offset: int, nbytes: int
) -> None:
    """`InvalidRequest` unless the heads exist, the slots are a 1-D int64 device tensor and the block fits."""
    if num_heads <= 0 or head_start < 0 or head_start + num_heads > kv.num_heads:
        raise InvalidRequest(
            f"head range [{head_start}, {head_start + num_heads}) is outside this KV's {kv.num_heads} local heads"
        )
    if slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous() or slots.device != kv.device:
        raise InvalidRequest(
            f"slots must be a contiguous 1-D int64 tensor on {kv.device}, got {slots.dtype} of shape "
            f"{tuple(slots.shape)} on {slots.device}"
        )
    if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous() or staging.device != kv.device:
        raise InvalidRequest(
            f"staging must be a contiguous 1-D uint8 tensor on {kv.device}, got {staging.dtype} of shape "
            f"{tuple(staging.shape)} on {staging.device}"
        )
    if offset < 0 or offset + nbytes > staging.numel():
        raise InvalidRequest(
            f"staging block [{offset}, {offset + nbytes}) does not fit a staging buffer of {staging.numel()} bytes"
        )


@triton.jit  # type: ignore[untyped-decorator]
def _copy_kernel(  # type: ignore[no-untyped-def]
    kv_ptr,
    table_ptr,
    slots_ptr,
    block_ptr,
    block_offset,
    num_tokens,
    num_slots,
    layer_first,
    layer_stride,
    page_stride,
    pos_stride,
    head_stride,
    head_start,
    block_bytes,
    PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_BYTES: tl.constexpr,
    HEADS_P2: tl.constexpr,
    BYTES_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TABLE_ALIGN: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Copy a `[BLOCK_T tokens, heads, head bytes]` tile of one (K|V, layer) between the KV and the block(s): head h
    of the tile is head `h % NUM_HEADS` of block `h // NUM_HEADS`, the blocks `block_bytes` apart."""
    view = tl.program_id(1).to(tl.int64)
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + token, mask=token < num_tokens, other=-1)
    valid = (slot >= 0) & (slot < num_slots)
    if TABLE_ALIGN == 0:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
        layer = layer_first + view * layer_stride
    else:
        layer = tl.load(table_ptr + view) * TABLE_ALIGN
    row = layer + (slot // PAGE_SIZE) * page_stride + (slot % PAGE_SIZE) * pos_stride + head_start * head_stride
    head = tl.arange(0, HEADS_P2)
    byte = tl.arange(0, BYTES_P2)
    kv_at = kv_ptr + row[:, None, None] + (head * head_stride)[None, :, None] + byte[None, None, :]
    block_row = (view * num_tokens + token) * NUM_HEADS
    in_block = (head // NUM_HEADS).to(tl.int64) * block_bytes + (head % NUM_HEADS) * HEAD_BYTES
    block_at = block_ptr + block_offset + block_row[:, None, None] * HEAD_BYTES + in_block[None, :, None]
    block_at += byte[None, None, :]
    mask = valid[:, None, None] & (head < BLOCKS * NUM_HEADS)[None, :, None] & (byte < HEAD_BYTES)[None, None, :]
    if GATHER:
        tl.store(block_at, tl.load(kv_at, mask=mask), mask=mask)
    else:
        tl.store(kv_at, tl.load(block_at, mask=mask), mask=mask)
