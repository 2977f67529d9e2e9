"""Fault levels of the simulator: what the world may do wrong, and how often.

Owns: `FaultProfile` (a frozen bundle of probabilities and switches) and `FAULT_LEVELS`, the three named levels
`none`, `default` and `heavy` that `kvstage sim --faults` selects.

- `none`: a perfect world; every room must succeed.
- `default`: about 8% of control messages lost, 2% duplicated, random delay (hence reordering), 10% of rooms
  aborted (from either side), some rooms with deadlines too tight to finish, some bulk-write and scatter failures,
  writes that stall past the transport's bound, drifting clocks, and, in some seeds, each process fault of
  `heavy` once: a writer cut off on the control plane, a stalled writer, a decode crash, a writer restarting
  during a quarantine, and hostile frames (forged, stale and replayed); a writer restarting with a write posted at
  the end of its lease and landing at the end of `max_write_s`, and clocks at the edge of the allowed drift.
- `heavy`: more of everything, plus prefill crash and restart (new session id), network partitions, and a ring
  small enough to force wrapping.

The process faults are counts per seed: a fraction `x` means one event in that share of seeds (`1.5`: one, and
a second in half the seeds).

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
    stalled_writes: float = 0.0
    """Share of writes that stall for 0.1-1.5 x `max_write_s`: those past the bound fail without landing (the
    transport's contract), the others land late, after their room may have failed (R6, leases)."""
    tight_deadlines: float = 0.0
    """Share of rooms whose deadline is 10-150 ms after arrival, so their deadline fires mid-handoff."""
    drifting_clocks: bool = False
    """Each node's clock reads offset + rate * t, rate within `Timing.clock_drift` of 1."""
    prefill_crashes: int = 0
    writer_partitions: float = 0.0
    """One writer (a prefill rank) loses its control frames, both ways or one way, for 0.3-2 x dead_after_s;
    its data path stays up, degraded (its writes take 0.5-1 x max_write_s), so it may still land writes."""
    writer_pauses: float = 0.0
    """A writer stalls (GC, swap) for 0.3-1.8 x dead_after_s (mostly longer than dead_after_s) right after it asks
    for a write: it handles no event and posts nothing meanwhile, then resumes with the queued write, which takes
    0.5-1 x max_write_s (the process is still slow)."""
    decode_crashes: float = 0.0
    """A decode instance crashes while a write to it is in flight (writers hold grants) and restarts with new
    sessions 0.05-1.5 s later: every room it held ends."""
    quarantine_restarts: float = 0.0
    """A prefill instance crashes right after posting a write that takes 0.5-1 x max_write_s, and restarts 10-50 ms
    later: decode meets the new incarnation while the old one's write is in flight, and quarantines its room."""
    edge_restarts: float = 0.0
    """A writer stalls right after it next asks for a write until just before its lease towards that decode rank
    runs out (a slow post), then posts it; the write takes 0.9-1 x max_write_s, and the writer's instance crashes
    right after posting, sending nothing more, and restarts 10-50 ms later (decode quarantines the old
    incarnation's space) or, in half of them, 1-1.5 x dead_after_s later (decode declares it dead first). Either
    way a write sits at the edge of both bounds: posted at the end of its lease, landing at the end of
    `max_write_s`, while decode's quarantine or death timer runs."""
    edge_clocks: bool = False
    """In seeds with an edge restart, clocks drift at their bound the worst way for the quarantine: decode hosts'
    run at 1 + `clock_drift`, prefill hosts' at 1 - `clock_drift` (with `drifting_clocks`)."""
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
        loss=0.08,
        duplicate=0.02,
        delay_jitter=0.004,
        abort_rooms=0.10,
        write_failure=0.005,
        slow_writes=0.05,
        scatter_failure=0.002,
        hostile_frames=0.02,
        send_failure=0.0005,
        stalled_writes=0.002,
        tight_deadlines=0.03,
        drifting_clocks=True,
        writer_partitions=0.3,
        writer_pauses=0.3,
        decode_crashes=0.2,
        quarantine_restarts=0.3,
        edge_restarts=0.5,
        edge_clocks=True,
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
        stalled_writes=0.01,
        tight_deadlines=0.05,
        drifting_clocks=True,
        prefill_crashes=1,
        writer_partitions=1.0,
        writer_pauses=1.0,
        decode_crashes=0.5,
        quarantine_restarts=1.0,
        edge_restarts=1.0,
        edge_clocks=True,
        partitions=2,
        partition_length=1.4,
        ring_chunks=2.0,
    ),
}
