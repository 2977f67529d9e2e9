"""`StreamGate`: a CUDA stream held until the test lets it go, not for a guessed number of GPU cycles.

A one-thread kernel queued on the stream spins until a flag in device memory is set, which `release` does from a
stream of its own (the spin leaves the rest of the GPU free), so whatever the test queues behind the gate runs
only after `release`, however slow the machine. A gate never left open still ends by itself after `limit_s`, so a
failing test cannot leave a kernel spinning on the GPU. GPU tests only.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]

from kvstage.transport.data.bounded_copy import globaltimer


@triton.jit
def _gate_kernel(flag_ptr, limit_ns):  # type: ignore[no-untyped-def]
    start = globaltimer()
    now = start
    shut = tl.load(flag_ptr, volatile=True) == 0
    while shut & (now - start < limit_ns):
        shut = tl.load(flag_ptr, volatile=True) == 0
        now = globaltimer()


class StreamGate:
    """Holds the streams given to `hold` until `release` (or `limit_s`); a context manager that releases on exit."""

    def __init__(self, device: str = "cuda", limit_s: float = 60.0) -> None:
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._side = torch.cuda.Stream(device)
        self._limit_ns = int(limit_s * 1e9)
        torch.cuda.synchronize(device)  # the flag is zero before any stream waits on it

    def hold(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Hold `stream` at this point; the returned event completes once the gate has opened."""
        with torch.cuda.stream(stream):
            _gate_kernel[(1,)](self._flag, self._limit_ns)
            passed = torch.cuda.Event()
            passed.record(stream)
        return passed

    def release(self) -> None:
        with torch.cuda.stream(self._side):
            self._flag.fill_(1)
        self._side.synchronize()

    def __enter__(self) -> StreamGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
