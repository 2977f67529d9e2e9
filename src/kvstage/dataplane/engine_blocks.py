"""Page runs between two engines' own KV caches: the direct path at matched TP when both sides are vLLM's.

Owns `EngineBlocks` (where each (layer, block) of a rank's engine KV lies in its one allocation: the byte offset of
each layer's block 0, the stride between blocks, the bytes of one block; published by each rank, bounded when
decoded), `describe_blocks` (an `EngineKV`'s, with the allocation to register, or None where its blocks are not whole
runs of one allocation in host memory) and `block_runs` (the writes that move a chunk's blocks from one rank to
another: one run per (layer, block), merged wherever consecutive runs are contiguous on both sides).

vLLM's CPU cache holds each (layer, block) as one run, `[heads, 2 * block_size, head_dim]` (K transposed, then V),
all layers in one allocation (`vllm.v1.worker.utils.allocate_kv_cache`). At matched TP sizes a decode rank holds
exactly the heads of its prefill rank, in the same order, so where both sides use the same format, dtype and block
size a block's bytes are the same on both sides and move as they are: no gather, no staging ring, no scatter.

Invariants: two ranks' blocks are `compatible` only if every byte of a block means the same on both (format, page
size and block bytes equal); a run never leaves either side's allocation (`block_runs` checks every block id
against both sides' block counts); a chunk moves whole blocks, so the last block's positions past the prompt carry
prefill's bytes, which the decode engine overwrites before it reads them (a block past the prompt's end is the
request's own, never a prefix-cache block). Pure arithmetic but for `describe_blocks`, which reads tensor addresses.
Called by the runtime agents (runtime/agent.py publishes, runtime/prefill.py writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
from msgspec import Meta

from kvstage.dataplane.engine_kv import EngineKV, KVCacheFormat
from kvstage.errors import InvalidRequest

#: Bytes of an allocation, or an offset in it (2**62: far beyond any host's memory).
_Bytes = Annotated[int, Meta(ge=0, le=2**62)]


class EngineBlocks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Layer `l`'s block `b` of one rank's engine KV is the `block_bytes` bytes at
    `layer_offsets[l] + b * block_stride` of its allocation (`num_blocks` blocks of `page_size` tokens each)."""

    format: Annotated[str, Meta(max_length=32)]
    page_size: Annotated[int, Meta(ge=1, le=2**20)]
    block_bytes: Annotated[int, Meta(ge=1, le=2**40)]
    block_stride: _Bytes
    num_blocks: Annotated[int, Meta(ge=1, le=2**40)]
    layer_offsets: Annotated[tuple[_Bytes, ...], Meta(min_length=1, max_length=4096)]

    def compatible(self, other: EngineBlocks) -> bool:
        """Whether a block of `other` means, byte for byte, what a block of this rank does."""
        same = (self.format, self.page_size, self.block_bytes, len(self.layer_offsets))
        return same == (other.format, other.page_size, other.block_bytes, len(other.layer_offsets))

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, blob: bytes) -> EngineBlocks:
        """From a peer's record; `msgspec.ValidationError` / `DecodeError` if it breaks a bound."""
        return msgspec.msgpack.decode(blob, type=cls)


def describe_blocks(kv: EngineKV) -> tuple[EngineBlocks, int, int] | None:
    """`kv`'s blocks, with the address and size of the one allocation that holds them (to register with a
    transport), or None: not vLLM's CPU format in host memory, or its layers not all in one allocation."""
    if kv.format is not KVCacheFormat.VLLM_CPU or kv.device.type != "cpu":
        return None
    layout = kv.layout
    storages = {kv.k(layer).untyped_storage().data_ptr() for layer in range(layout.num_layers)}
    if len(storages) != 1:
        return None
    storage = kv.k(0).untyped_storage()
    base, itemsize = storage.data_ptr(), layout.itemsize
    keys = kv.k(0)
    heads = kv.geometry.num_heads
    blocks = EngineBlocks(
        format=str(kv.format),
        page_size=layout.page_size,
        block_bytes=heads * 2 * layout.page_size * layout.head_bytes,
        block_stride=keys.stride(0) * itemsize,
        num_blocks=kv.geometry.num_pages,
        layer_offsets=tuple(kv.k(layer).data_ptr() - base for layer in range(layout.num_layers)),
    )
    return blocks, base, storage.nbytes()


def block_runs(
    src: EngineBlocks, dst: EngineBlocks, src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, length) of the writes that copy every layer of `src_blocks[i]` into
    `dst_blocks[i]`, in source order, each one as long as both sides' memory stays contiguous."""
    if not src.compatible(dst) or len(src_blocks) != len(dst_blocks):
        raise InvalidRequest(f"engine blocks {src} and {dst} are not the same layout, or the block lists differ")
    for blocks, side in ((src_blocks, src), (dst_blocks, dst)):
        if any(not 0 <= b < side.num_blocks for b in blocks):
            raise InvalidRequest(f"blocks {list(blocks)} reach outside 0..{side.num_blocks - 1}")
    size = src.block_bytes
    pieces = sorted(
        (src_layer + s * src.block_stride, dst_layer + d * dst.block_stride)
        for src_layer, dst_layer in zip(src.layer_offsets, dst.layer_offsets, strict=True)
        for s, d in zip(src_blocks, dst_blocks, strict=True)
    )
    runs: list[tuple[int, int, int]] = []
    for s_off, d_off in pieces:
        if runs and runs[-1][0] + runs[-1][2] == s_off and runs[-1][1] + runs[-1][2] == d_off:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + size)
        else:
            runs.append((s_off, d_off, size))
    return runs
