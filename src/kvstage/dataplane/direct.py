"""The direct per-slice path: prefill pool to decode pool, one (layer, K/V, page, head run) slice at a time.

Owns `SliceCopy` (a byte-addressed, possibly strided copy descriptor), `plan_direct_slices` (the descriptors of
one head transfer over a token range) and `copy_direct` (executes descriptors one by one and counts them).

This is the baseline that staging must beat: it issues `2 * num_layers * pages * head_runs` operations per
request, where staging issues one bulk write per writer per chunk. Descriptors carry byte offsets into the two
pools' flat storage (`KVPool.flat`), so a transport (Mooncake, NIXL) can issue one write per descriptor, or one
per row where its transport cannot stride (`SliceCopy.writes`).

Invariants: descriptors are computed from `PoolGeometry` alone and validated like staged copies (token range,
page range, distinct pages, head range); a slice never leaves either pool's storage, and never crosses a page
boundary of either side (the two pools may differ in page size).

Called by the benchmarks, the simulator's direct path, the demo, and the transports' per-slice mode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvstage.dataplane.pool import KVPool, Pages, PoolGeometry
from kvstage.errors import InvalidRequest
from kvstage.layout import HeadTransfer


@dataclass(frozen=True, slots=True)
class SliceCopy:
    """Copy `rows` rows of `row_bytes` bytes; row i is at `src_offset + i*src_stride` and `dst_offset + i*dst_stride`.

    One slice is one (layer, K/V, page, head run); its rows are the page's tokens in the token range.
    """

    src_offset: int
    dst_offset: int
    row_bytes: int
    rows: int
    src_stride: int
    dst_stride: int

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.rows

    @property
    def contiguous(self) -> bool:
        """True when source and destination are each one contiguous byte range."""
        return self.rows == 1 or self.src_stride == self.dst_stride == self.row_bytes

    @property
    def writes(self) -> int:
        """Contiguous writes a transport without strided writes issues for this slice."""
        return 1 if self.contiguous else self.rows

    def runs(self) -> list[tuple[int, int, int]]:
        """Those writes, as (src offset, dst offset, length): the whole slice if contiguous, else one per row."""
        if self.contiguous:
            return [(self.src_offset, self.dst_offset, self.nbytes)]
        return [
            (self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride, self.row_bytes)
            for i in range(self.rows)
        ]


def plan_direct_slices(
    src: PoolGeometry,
    dst: PoolGeometry,
    transfer: HeadTransfer,
    src_pages: Pages,
    dst_pages: Pages,
    token_start: int,
    token_end: int,
    *,
    src_shift: int = 0,
) -> tuple[SliceCopy, ...]:
    """Descriptors moving `transfer`'s heads of tokens `[token_start, token_end)` of `dst_pages`, read from tokens
    `[token_start + src_shift, token_end + src_shift)` of `src_pages`, ordered by layer, K/V, then token. The two
    pools may differ in page size (nothing else): a slice then ends wherever a page of either side does."""
    if replace(src.layout, page_size=dst.layout.page_size) != dst.layout:
        raise InvalidRequest(f"prefill layout {src.layout} differs from decode layout {dst.layout}")
    src.check_heads(transfer.src_head_start, transfer.num_heads)
    dst.check_heads(transfer.dst_head_start, transfer.num_heads)
    pieces = _pieces(src, dst, src_pages, dst_pages, token_start, token_end, src_shift)
    row_bytes = transfer.num_heads * src.layout.head_bytes
    return tuple(
        SliceCopy(
            src.byte_offset(kv, layer, src_slot, transfer.src_head_start),
            dst.byte_offset(kv, layer, dst_slot, transfer.dst_head_start),
            row_bytes,
            rows,
            src.slot_bytes,
            dst.slot_bytes,
        )
        for layer in range(src.layout.num_layers)
        for kv in (0, 1)
        for src_slot, dst_slot, rows in pieces
    )


def _pieces(
    src: PoolGeometry,
    dst: PoolGeometry,
    src_pages: Pages,
    dst_pages: Pages,
    token_start: int,
    token_end: int,
    src_shift: int,
) -> list[tuple[int, int, int]]:
    """(source slot, destination slot, tokens) of each run of the token range that lies in one page on both sides,
    in token order; the pages are checked (`used_pages`)."""
    src_used = src.used_pages(src_pages, token_start + src_shift, token_end + src_shift).tolist()
    dst_used = dst.used_pages(dst_pages, token_start, token_end).tolist()
    src_size, dst_size = src.layout.page_size, dst.layout.page_size
    src_first, dst_first = (token_start + src_shift) // src_size, token_start // dst_size
    pieces = []
    token = token_start
    while token < token_end:
        src_token = token + src_shift
        src_page, src_in = divmod(src_token, src_size)
        dst_page, dst_in = divmod(token, dst_size)
        rows = min(token_end - token, src_size - src_in, dst_size - dst_in)
        src_slot = src_used[src_page - src_first] * src_size + src_in
        pieces.append((src_slot, dst_used[dst_page - dst_first] * dst_size + dst_in, rows))
        token += rows
    return pieces


def _rows(flat: torch.Tensor, offset: int, stride: int, copy: SliceCopy) -> torch.Tensor:
    last = offset + (copy.rows - 1) * stride + copy.row_bytes
    if offset < 0 or last > flat.numel():
        raise InvalidRequest(f"slice [{offset}, {last}) leaves a pool of {flat.numel()} bytes")
    return flat.as_strided((copy.rows, copy.row_bytes), (stride, 1), flat.storage_offset() + offset)


def copy_direct(src: KVPool, dst: KVPool, slices: tuple[SliceCopy, ...] | list[SliceCopy]) -> int:
    """Execute `slices` from `src` into `dst`, one torch copy per slice; returns the operations issued.

    Checks that each slice stays inside both pools; `transfer_direct` also checks the pages are allocated.
    """
    ops = 0
    for copy in slices:
        _rows(dst.flat, copy.dst_offset, copy.dst_stride, copy).copy_(
            _rows(src.flat, copy.src_offset, copy.src_stride, copy)
        )
        ops += 1
    return ops


def transfer_direct(
    src: KVPool,
    dst: KVPool,
    transfer: HeadTransfer,
    src_pages: Pages,
    dst_pages: Pages,
    token_start: int,
    token_end: int,
    *,
    src_shift: int = 0,
) -> int:
    """Move one head transfer of tokens `[token_start, token_end)` slice by slice (`plan_direct_slices`, read
    `src_shift` tokens later on the source); returns the operations issued.

    Both page lists must be allocated in their pools, like for staged copies.
    """
    src.allocator.check_held(src.geometry.used_pages(src_pages, token_start + src_shift, token_end + src_shift))
    dst.allocator.check_held(dst.geometry.used_pages(dst_pages, token_start, token_end))
    slices = plan_direct_slices(
        src.geometry, dst.geometry, transfer, src_pages, dst_pages, token_start, token_end, src_shift=src_shift
    )
    return copy_direct(src, dst, slices)
