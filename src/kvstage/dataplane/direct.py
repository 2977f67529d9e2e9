"""The direct per-slice path: prefill pool to decode pool, one (layer, K/V, page, head run) slice at a time.

Owns `SliceCopy` (a byte-addressed, possibly strided copy descriptor), `plan_direct_slices` (the descriptors of
one head transfer over a token range) and `copy_direct` (executes descriptors one by one and counts them).

This is the baseline that staging must beat: it issues `2 * num_layers * pages * head_runs` operations per
request, where staging issues one bulk write per writer per chunk. Descriptors carry byte offsets into the two
pools' flat storage (`KVPool.flat`), so a transport (Mooncake, NIXL) can issue one write per descriptor, or one
per row where its transport cannot stride (`SliceCopy.writes`).

Invariants: descriptors are computed from `PoolGeometry` alone and validated like staged copies (token range,
page range, distinct pages, head range); a slice never leaves either pool's storage.

Called by the benchmarks, the simulator's direct path, the demo, and the transports' per-slice mode.
"""

from __future__ import annotations

from dataclasses import dataclass

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
) -> tuple[SliceCopy, ...]:
    """Descriptors moving `transfer`'s heads of tokens `[token_start, token_end)`, ordered by layer, K/V, page."""
    if src.layout != dst.layout:
        raise InvalidRequest(f"prefill layout {src.layout} differs from decode layout {dst.layout}")
    src.check_heads(transfer.src_head_start, transfer.num_heads)
    dst.check_heads(transfer.dst_head_start, transfer.num_heads)
    src_used = src.used_pages(src_pages, token_start, token_end).tolist()
    dst_used = dst.used_pages(dst_pages, token_start, token_end).tolist()
    page_size = src.layout.page_size
    first_page = token_start // page_size
    row_bytes = transfer.num_heads * src.layout.head_bytes
    slices: list[SliceCopy] = []
    for layer in range(src.layout.num_layers):
        for kv in (0, 1):
            for index, (src_page, dst_page) in enumerate(zip(src_used, dst_used, strict=True)):
                page_start = (first_page + index) * page_size
                lo, hi = max(token_start, page_start), min(token_end, page_start + page_size)
                in_page = lo - page_start
                slices.append(
                    SliceCopy(
                        src.byte_offset(kv, layer, src_page * page_size + in_page, transfer.src_head_start),
                        dst.byte_offset(kv, layer, dst_page * page_size + in_page, transfer.dst_head_start),
                        row_bytes,
                        hi - lo,
                        src.slot_bytes,
                        dst.slot_bytes,
                    )
                )
    return tuple(slices)


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
) -> int:
    """Move one head transfer of tokens `[token_start, token_end)` slice by slice; returns the operations issued.

    Both page lists must be allocated in their pools, like for staged copies.
    """
    src.allocator.check_held(src.geometry.used_pages(src_pages, token_start, token_end))
    dst.allocator.check_held(dst.geometry.used_pages(dst_pages, token_start, token_end))
    slices = plan_direct_slices(src.geometry, dst.geometry, transfer, src_pages, dst_pages, token_start, token_end)
    return copy_direct(src, dst, slices)
