"""A device copy that writes nothing past a deadline: the cuda_ipc backend's hard bound on late copies.

Owns `DeviceClock` (the GPU's `%globaltimer` against the host's `time.monotonic()`) and `bounded_copy`, a Triton
copy kernel each of whose programs reads `%globaltimer` once, before any store, and writes nothing (counting
itself in `skipped`) when the clock has passed the deadline. A program that passed the check stores at most
`PROGRAM_BYTES`, which lands within microseconds; so no byte of the copy is written after the deadline plus that.

Clock mapping. `DeviceClock.calibrate` reads `%globaltimer` in a one-thread kernel between two host readings
`t0 <= t_read <= t1`; `g - t1` is then a lower bound of the true offset (device clock minus host clock), so a
deadline mapped with it is never later on the device than on the host: the device stops early by at most
`t1 - t0` (tens of microseconds), never late. The two clocks drift apart by parts per million, so the mapping is
refreshed every `RECALIBRATE_S` and the device deadline is taken `MARGIN_NS` early. A calibration none of whose
readings is bounded within `MAX_ROUND_TRIP_NS` (the calling thread waited on the GIL after each, say, in a busy engine
process) keeps the last mapping while it is younger than `MAX_MAPPING_AGE_S` (twice the usual age) and is tried again
after `RETRY_S`; with no mapping that young it raises `TransportError`, failing the write.

The kernel is compiled per element width and per 16-byte alignment of the skipped count (no specialisation on the
copy's alignment or length), when the clock is made, so no write compiles it.
Called by transport/data/cuda_ipc.py: a clock per GPU a transport writes from, made when a GPU region is allocated
or registered there, read (and recalibrated) on the thread that queues the writes (the agent's reactor).
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]

from kvstage.errors import TransportError

log = logging.getLogger(__name__)

#: Bytes one program of the copy stores after its clock check.
PROGRAM_BYTES = 16 << 10
#: How early, on the device, a deadline is taken (clock drift between calibrations, and a program's own stores).
MARGIN_NS = 1_000_000
#: How often the device clock is mapped to the host's again.
RECALIBRATE_S = 5.0
#: A reading whose host readings are further apart than this is not used.
MAX_ROUND_TRIP_NS = 2_000_000
_TRIES = 8
#: A failed recalibration is tried again after this long, on the next write; meanwhile the last mapping is used
#: while it is younger than MAX_MAPPING_AGE_S.
RETRY_S = 0.5
MAX_MAPPING_AGE_S = 2 * RECALIBRATE_S
#: Element types a copy runs in, widest first: offsets and lengths divisible by the item size take it.
_WIDTHS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@triton.jit
def globaltimer():  # type: ignore[no-untyped-def]
    """The GPU's nanosecond clock (`%globaltimer`), inside a Triton kernel."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _read_clock_kernel(out_ptr):  # type: ignore[no-untyped-def]
    tl.store(out_ptr, globaltimer())


@triton.jit(do_not_specialize=["n", "deadline"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])  # type: ignore[untyped-decorator]
def _bounded_copy_kernel(src_ptr, dst_ptr, n, deadline, skipped_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Program p copies items [p * BLOCK, (p + 1) * BLOCK) of `n`, unless `%globaltimer` has passed `deadline` when
    it starts: then it stores nothing and adds one to `skipped`."""
    if globaltimer() > deadline:
        tl.atomic_add(skipped_ptr, 1)
    else:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


class DeviceClock:
    """The offset of one GPU's `%globaltimer` from the host's `time.monotonic()`, bounded from below. Made when a
    transport first meets the GPU (at registration, not on a write): it compiles the copy kernel for every element
    width there, so that no write's deadline ever runs out while Triton compiles."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._out = torch.zeros(1, dtype=torch.int64, device=device)
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # read without a blocking device copy
        self._offset_ns = 0
        self._calibrated = -MAX_MAPPING_AGE_S  # when the offset was measured
        self._next_try = 0.0  # when to measure it again
        self._compile()
        self.calibrate()

    def _compile(self) -> None:
        """One small copy per element width and counter alignment, with no deadline to speak of, on this clock's
        stream."""
        buffers = torch.zeros(2, 64, dtype=torch.uint8, device=self._device)
        skipped = torch.zeros(2, dtype=torch.int32, device=self._device)
        with torch.cuda.stream(self._stream):
            for width in _WIDTHS:
                for count in (skipped[:1], skipped[1:]):  # Triton specialises on the count's 16-byte alignment, and
                    # a write's counter slot (cuda_ipc's `_Counters`) has it or not: compile both now, not at a write
                    bounded_copy(buffers[1, : width.itemsize], buffers[0, : width.itemsize], 2**62, count)
            _read_clock_kernel[(1,)](self._out)
        self._stream.synchronize()

    def deadline_ns(self, host_deadline_s: float) -> int:
        """The device-clock reading by which a copy must stop to stop by `host_deadline_s` (a `time.monotonic()`
        reading) on the host, `MARGIN_NS` early."""
        if time.monotonic() >= self._next_try:
            self.calibrate()
        return int(host_deadline_s * 1e9) + self._offset_ns - MARGIN_NS

    def calibrate(self) -> None:
        """Read the device clock between two host readings on a stream of its own (a host wait of tens of
        microseconds on the calling thread); keep the tightest lower bound of the offset of `_TRIES` readings."""
        best: int | None = None
        with self._lock, torch.cuda.stream(self._stream):
            for _ in range(_TRIES):
                before = time.monotonic_ns()
                _read_clock_kernel[(1,)](self._out)
                self._host.copy_(self._out, non_blocking=True)
                self._stream.synchronize()
                after = time.monotonic_ns()
                if after - before <= MAX_ROUND_TRIP_NS:
                    low = int(self._host[0]) - after
                    best = low if best is None else max(best, low)
            now = time.monotonic()
            if best is not None:
                self._offset_ns, self._calibrated, self._next_try = best, now, now + RECALIBRATE_S
                return
            age = now - self._calibrated
            if age >= MAX_MAPPING_AGE_S:
                raise TransportError(f"cannot map {self._device}'s clock to the host's: every reading took over 2 ms")
            self._next_try = now + RETRY_S
            log.warning("%s: every clock reading took over 2 ms; keeping the mapping of %.1f s ago", self._device, age)


def bounded_copy(dst: torch.Tensor, src: torch.Tensor, deadline_ns: int, skipped: torch.Tensor) -> int:
    """Queue, on the current stream, a copy of the uint8 tensor `src` into `dst` (same length) that stores nothing
    once the device clock has passed `deadline_ns`; each program that did not copy adds one to `skipped` (int32).
    Returns how many programs it queued."""
    width = next(w for w in _WIDTHS if _aligned(dst, src, w.itemsize))
    items = src.numel() // width.itemsize
    block = max(PROGRAM_BYTES // width.itemsize, 1)
    grid = (triton.cdiv(items, block),)
    _bounded_copy_kernel[grid](src.view(width), dst.view(width), items, deadline_ns, skipped, BLOCK=block)
    return int(grid[0])


def _aligned(dst: torch.Tensor, src: torch.Tensor, size: int) -> bool:
    return src.numel() % size == 0 and dst.data_ptr() % size == 0 and src.data_ptr() % size == 0
