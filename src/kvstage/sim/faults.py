"""Fault levels of the simulator: what the world may do wrong, and how often.

Owns: `FaultProfile` (a frozen bundle of probabilities and switches) and `FAULT_LEVELS`, the three named levels
`none`, `default` and `heavy` that `kvstage sim --faults` selects.

- `none`: a perfect world; every room must succeed.
- `default`: about 5% of control messages lost, 2% duplicated, random delay (hence reordering), 10% of rooms
  aborted (from either side), some bulk-write and scatter failures, and a few hostile frames.
- `heavy`: more of everything, plus prefill crash and restart (new session id), network partitions, and a ring
  small enough to force wrapping.

Pure data. Called by the world (world.py, core.py) and sim/network.py; named by cli.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FaultProfile:
    """Probabilities are per event (message, write, room); times are in virtual seconds."""

    name: str
    loss: float = 0.0
    duplicate: float = 0.0
    delay_min: float = 0.0005
    delay_jitter: float = 0.0
    abort_rooms: float = 0.0
    write_failure: float = 0.0
    slow_writes: float = 0.0
    """Share of bulk/direct writes that take 10-60 ms longer (a congested link): they are still in flight when
    rooms abort or fail, which is when a released region can be hit by a late write (R6)."""
    scatter_failure: float = 0.0
    hostile_frames: float = 0.0
    send_failure: float = 0.0
    """A Send the runtime could not carry out (answered with SendFailed): fails that room only (R3)."""
    prefill_crashes: int = 0
    partitions: int = 0
    partition_length: float = 0.0
    """Longest partition; partitions last 0.1 s up to this, some longer than the peer-death timeout."""
    ring_chunks: float = 6.0
    """Staging ring capacity, in largest-chunk regions; 1-2 forces wrapping on nearly every allocation, and
    below 1 the largest chunks cannot fit at all (their rooms fail "staging oversized")."""


FAULT_LEVELS: dict[str, FaultProfile] = {
    "none": FaultProfile("none"),
    "default": FaultProfile(
        "default",
        loss=0.05,
        duplicate=0.02,
        delay_jitter=0.004,
        abort_rooms=0.10,
        write_failure=0.005,
        slow_writes=0.05,
        scatter_failure=0.002,
        hostile_frames=0.01,
        send_failure=0.0005,
    ),
    "heavy": FaultProfile(
        "heavy",
        loss=0.10,
        duplicate=0.05,
        delay_jitter=0.010,
        abort_rooms=0.15,
        write_failure=0.015,
        slow_writes=0.10,
        scatter_failure=0.005,
        hostile_frames=0.03,
        send_failure=0.002,
        prefill_crashes=1,
        partitions=2,
        partition_length=1.4,
        ring_chunks=2.0,
    ),
}
