"""The simulated control-plane network: loss, duplication, delay (hence reordering) and partitions.

Owns: `Network`, which takes a frame from one endpoint address to another and schedules zero, one or two
deliveries on the world's `EventQueue`. Every random choice is drawn from the world's one `random.Random`, in
a fixed order, so a seed replays exactly. Frames are opaque bytes here: endpoints encode and decode them with
the real wire codec, so hostile or truncated frames exercise the real decoder.

Invariants: a frame is never delivered before it is sent; a partition drops every frame sent across it (in the
directions it cuts) while it lasts; nothing else is dropped except by the profile's loss probability. A partition
cuts the data path too (writes posted across it fail) unless it is a control-plane partition. Called by
sim/world.py and sim/dataplane.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvstage.sim.clock import EventKind, EventQueue
from kvstage.sim.faults import FaultProfile


@dataclass(frozen=True, slots=True)
class Delivery:
    """A frame on its way from `src` to `dst`."""

    src: str
    dst: str
    frame: bytes


@dataclass(slots=True)
class NetworkStats:
    sent: int = 0
    lost: int = 0
    duplicated: int = 0
    partitioned: int = 0


@dataclass(slots=True)
class Partition:
    """Frames from `side` out (`outbound`) and from outside in (`inbound`) are dropped until `until`; writes
    across it fail too when `data`."""

    side: frozenset[str]
    until: float
    data: bool = True
    inbound: bool = True
    outbound: bool = True

    def cuts(self, src: str, dst: str) -> bool:
        inside = src in self.side
        if inside == (dst in self.side):
            return False
        return self.outbound if inside else self.inbound


@dataclass(slots=True)
class Network:
    rng: random.Random
    profile: FaultProfile
    queue: EventQueue
    stats: NetworkStats = field(default_factory=NetworkStats)
    partitions: list[Partition] = field(default_factory=list)

    def send(self, src: str, dst: str, frame: bytes) -> bool:
        """Put `frame` on the wire; it may be lost, duplicated, delayed or cut off by a partition. False if it was
        dropped (lost or cut off)."""
        self.stats.sent += 1
        now = self.queue.now
        if self.cut(src, dst, now):
            self.stats.partitioned += 1
            return False
        profile = self.profile
        if profile.loss and self.rng.random() < profile.loss:
            self.stats.lost += 1
            return False
        copies = 2 if profile.duplicate and self.rng.random() < profile.duplicate else 1
        self.stats.duplicated += copies - 1
        delivery = Delivery(src, dst, frame)
        for _ in range(copies):
            self.queue.push(now + self.delay(), EventKind.DELIVER, delivery)
        return True

    def delay(self) -> float:
        jitter = self.profile.delay_jitter
        return self.profile.delay_min + (self.rng.expovariate(1.0 / jitter) if jitter else 0.0)

    def cut(self, src: str, dst: str, now: float, *, data: bool = False) -> bool:
        """True while a partition cuts frames (or, with `data`, writes) from `src` to `dst`."""
        if not self.partitions:
            return False
        self.partitions = [p for p in self.partitions if p.until > now]
        return any(p.cuts(src, dst) for p in self.partitions if p.data or not data)

    def control_cut_off(self, peer: str, now: float) -> bool:
        """True while a control-plane partition cuts `peer` off (its data path is up, but degraded)."""
        return any(not p.data and peer in p.side and p.until > now for p in self.partitions)

    def partition(self, partition: Partition) -> None:
        self.partitions.append(partition)
