"""Copy fences: the point on a CUDA stream after which the copies queued before it have landed.

Owns `CopyFence` (one CUDA event, asked with `done()`, which never waits) and `LANDED`, the fence of work that has
already landed: CPU copies, and host-staging copies that return only once their bytes are there. The CPU path thus
keeps the same interface, and its fences do nothing.

Invariants: a fence is recorded on the stream that queued the copies, after them; `done()` is True only once every
copy queued before it on that stream has finished; `wait()` waits for that one event, never for a whole stream or
the device. Called by the agents' reactor (runtime/reactor.py records one after every gather and scatter), by the
decode agent (a chunk's ring space and a failed room's pages go back only once their scatters' fences are done) and
by dataplane.stage (its waiting calls wait for their own fence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class CopyFence:
    """An event recorded after queued copies (None: nothing to wait for)."""

    event: torch.cuda.Event | None = None

    @classmethod
    def record(cls, device: torch.device) -> CopyFence:
        """A fence after everything queued so far on `device`'s current stream; `LANDED` off CUDA."""
        if device.type != "cuda":
            return LANDED
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return cls(event)

    def done(self) -> bool:
        """Whether the copies before the fence have landed; never waits (a CUDA error raises RuntimeError)."""
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Block until the copies before the fence have landed (this event only)."""
        if self.event is not None:
            self.event.synchronize()


LANDED = CopyFence()
"""The fence of copies that have already landed."""
