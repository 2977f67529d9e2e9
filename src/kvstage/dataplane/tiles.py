"""vLLM CPU's KV copied run by run: gather and scatter of `KVCacheFormat.VLLM_CPU` in host memory.

Owns `Tiles` (an engine's K and V as (block, head) tiles, every layer in one view where it can) and `block_runs`
(a copy's slots as runs of consecutive positions of one block).

vLLM's CPU attention stores each (block, head) of a layer as one run: K transposed, a `[head_dim, block_size]`
tile, then V, a `[block_size, head_dim]` tile (dataplane/engine_kv.py). A writer block holds each layer
token-major, `[tokens, heads, head_dim]` (docs/layout.md), so K is transposed on its way between the two and moves
in elements. A chunk's tokens fill whole blocks but at its edges, so a copy goes run by run: per run of consecutive
positions of one block, one strided torch copy moves the run's K of every layer (transposed in the copy, no index
per element) and one its V. How K's copy walks memory decides its speed (docs/benchmarks.md measures it): where a
tile's rows are a cache line or longer, a gather takes K a head at a time, and a scatter transposes runs of more
than `DIRECT_POSITIONS` positions through a buffer. Where the engine's layers are views of one allocation at a
constant stride (what vLLM allocates, layer-outer or block-outer), one view holds every layer; otherwise each layer
is copied on its own.

Invariants: copies go through integer views of the element's width, so every bit pattern survives (NaN payloads,
-0.0, fp8); a copy touches only its runs' positions of its heads; any slots are served, in any order (a run is one
position at worst). Called by dataplane.engine_kv (an `EngineKV` of format `vllm_cpu` in host memory builds its
`Tiles`) and dataplane.stage (whose gather and scatter copy through them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstage.dataplane.pool import WORD_DTYPES
from kvstage.errors import InvalidRequest

#: Bytes of a cache line: a gather copies K a head at a time where a tile's rows are this long or longer.
CACHE_LINE = 64
#: Positions of the longest run a scatter copies K of straight from the block; longer runs go through a buffer.
DIRECT_POSITIONS = 32


def block_runs(slots: torch.Tensor, page_size: int) -> list[tuple[int, int, int, int]]:
    """`(first token, block, first position, tokens)` of each run of `slots` (CPU int64, one per token) that holds
    consecutive positions of one block, in token order."""
    starts = torch.ones(slots.numel(), dtype=torch.bool)
    starts[1:] = (slots[1:] != slots[:-1] + 1) | (slots[1:] % page_size == 0)
    first = starts.nonzero().view(-1)
    counts = torch.diff(first, append=torch.tensor([slots.numel()]))
    blocks, positions = slots[first] // page_size, slots[first] % page_size
    return list(zip(first.tolist(), blocks.tolist(), positions.tolist(), counts.tolist(), strict=True))


@dataclass(frozen=True, slots=True)
class _Group:
    """Layers `[first, first + count)`: K `[count, blocks, heads, head_dim, block_size]` and V
    `[count, blocks, heads, block_size, head_dim]`, integers of the element's width."""

    first: int
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def layers(self) -> slice:
        return slice(self.first, self.first + self.keys.shape[0])


@dataclass(frozen=True, slots=True)
class Tiles:
    """One rank's KV as (block, head) tiles, in groups of layers: one group when every layer lies at a constant
    stride in one allocation, else one group per layer."""

    groups: tuple[_Group, ...]
    itemsize: int
    page_size: int

    @classmethod
    def of(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Tiles:
        """From per-layer K and V views `[blocks, block_size, heads, head_dim]` (any strides, one dtype)."""
        word = WORD_DTYPES[keys[0].element_size()]
        k_tiles = [k.view(word).permute(0, 2, 3, 1) for k in keys]
        v_tiles = [v.view(word).transpose(1, 2) for v in values]
        k_all, v_all = _stack(k_tiles), _stack(v_tiles)
        if k_all is not None and v_all is not None:
            groups: tuple[_Group, ...] = (_Group(0, k_all, v_all),)
        else:
            groups = tuple(_Group(i, k[None], v[None]) for i, (k, v) in enumerate(zip(k_tiles, v_tiles, strict=True)))
        return cls(groups, keys[0].element_size(), keys[0].shape[1])

    def gather(self, slots: torch.Tensor, heads: slice, block: torch.Tensor) -> None:
        """Copy `slots`' tokens of local `heads` into `block` `[2 (K, V), layers, tokens, heads, head_dim]`.

        Where a K tile's rows (one head_dim element over a block's positions) span a cache line, K is copied a head
        at a time: the rows one position of every head reads would not stay in cache while the copy walks the head
        dimension, those of one head do."""
        runs, count = self._runs(slots, block), heads.stop - heads.start
        step = 1 if self.page_size * self.itemsize >= CACHE_LINE else count
        for group in self.groups:
            keys, values = block[0, group.layers], block[1, group.layers]
            for token, page, position, length in runs:
                tokens, positions = slice(token, token + length), slice(position, position + length)
                for head in range(0, count, step):
                    tile = group.keys[:, page, heads.start + head : heads.start + head + step, :, positions]
                    keys[:, tokens, head : head + step].copy_(tile.permute(0, 3, 1, 2))
                values[:, tokens].copy_(group.values[:, page, heads, positions].transpose(1, 2))

    def scatter(self, block: torch.Tensor, slots: torch.Tensor, heads: slice) -> None:
        """Copy `block` `[2 (K, V), layers, tokens, heads, head_dim]` into `slots`' tokens of local `heads`.

        The transposing copy writes a tile row while it reads one element of every position of the run. In the
        block those lie `heads * head_dim` elements apart, a power of two that maps them to a few cache sets; runs
        longer than `DIRECT_POSITIONS` go through a buffer `[layers, heads, positions, head_dim]` instead, whose
        rows lie one head_dim apart."""
        runs = self._runs(slots, block)
        longest = max((length for *_, length in runs), default=0)
        for group in self.groups:
            keys, values = block[0, group.layers], block[1, group.layers]
            shape = (keys.shape[0], keys.shape[2], longest, keys.shape[3])
            rows = keys.new_empty(shape) if longest > DIRECT_POSITIONS else None
            for token, page, position, length in runs:
                tokens, positions = slice(token, token + length), slice(position, position + length)
                source = keys[:, tokens].transpose(1, 2)  # [layers, heads, positions, head_dim]
                if rows is not None and length > DIRECT_POSITIONS:
                    source = rows[:, :, :length].copy_(source)
                group.keys[:, page, heads, :, positions].copy_(source.transpose(2, 3))
                group.values[:, page, heads, positions].copy_(values[:, tokens].transpose(1, 2))

    def _runs(self, slots: torch.Tensor, block: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """`block_runs` of `slots`; `InvalidRequest` for a block of words narrower than the element (its address is
        not a multiple of the element's size)."""
        if block.element_size() != self.itemsize:
            raise InvalidRequest(
                f"a staging block aligned to {block.element_size()} bytes cannot be copied element by element into "
                f"vllm_cpu KV of {self.itemsize}-byte elements"
            )
        return block_runs(slots, self.page_size)


def _stack(views: list[torch.Tensor]) -> torch.Tensor | None:
    """`views` (one per layer, of one shape, strides and dtype) as one `[layers, ...]` view if they lie at a constant
    positive stride in one storage, else None."""
    first = views[0]
    storage, offsets = first.untyped_storage().data_ptr(), [view.storage_offset() for view in views]
    step = offsets[1] - offsets[0] if len(views) > 1 else 1
    if step <= 0 or any(
        (view.untyped_storage().data_ptr(), view.stride(), offset) != (storage, first.stride(), offsets[0] + i * step)
        for i, (view, offset) in enumerate(zip(views, offsets, strict=True))
    ):
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), offsets[0])
