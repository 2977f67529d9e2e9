"""What one seeded run simulates: the topology (instances and TP sizes) and the rooms (sizes, arrival, aborts).

Owns: `SimConfig` (the knobs `kvstage sim` exposes, plus the typed hooks tests use to plant bugs: the protocol
timing and the endpoint classes), `SIM_TIMING`, `Topology`, `RoomPlan` and `make_scenario`, which draws every
choice from the world's one `random.Random` so the same seed gives the same scenario.

A scenario always has at least 2 prefill instances feeding 1-2 decode instances. Unless the TP sizes are pinned,
instances get different TP sizes, so one run mixes fan-in (P > D), fan-out (P < D), replicated heads (TP > H)
and matched TP (the direct path); some seeds model an MLA model, where every room goes direct. Rooms range
from one chunk to many, some with a decode-side cached prefix.

Pure data plus the seeded draw. Called by the world's parts and sim/runner.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from kvstage.errors import ConfigError
from kvstage.layout import KVLayout, heads_of_rank, pages_for, plan_staging
from kvstage.protocol import DecodeEndpoint, PrefillEndpoint, Timing
from kvstage.sim.faults import FAULT_LEVELS, FaultProfile

#: Protocol timing in the simulated world: fast enough that runs are short, slow enough that delays matter.
SIM_TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, retry_initial_s=0.02, retry_max_s=0.25)

#: Head counts the simulator draws from when `--kv-heads` is not given.
HEAD_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
#: Longest decode-side cached prefix, in pages.
MAX_PREFIX_PAGES = 2
#: TP sizes the simulator draws from (kept small: every rank is a state machine in the run).
TP_CHOICES: tuple[int, ...] = (1, 2, 4)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Knobs of one run; `None` TP sizes and heads are drawn per seed."""

    faults: str = "default"
    payloads: bool = True
    prefill_tp: int | None = None
    decode_tp: int | None = None
    kv_heads: int | None = None
    rooms: int = 12
    num_layers: int = 2
    head_dim: int = 4
    page_size: int = 4
    chunk_tokens: int = 8
    max_chunks: int = 6
    room_budget: float = 3.0
    """Virtual seconds from a room's arrival to its deadline."""
    prefix_fraction: float = 0.25
    """Share of rooms with a decode-side cached prefix (only the suffix is transferred)."""
    prefill_pool_rooms: int = 3
    decode_pool_rooms: int = 4
    """KV pool sizes, in pages of the longest possible room: small, so rooms queue for pages on both sides."""
    mla_fraction: float = 0.15
    """Share of seeds (when --kv-heads is not pinned) that model an MLA model: every room takes the direct path."""
    fault_profile: FaultProfile | None = None
    """Overrides the named level (regression scenarios tune one fault at a time)."""
    timing: Timing = SIM_TIMING
    """Every endpoint's timing; the world's write bound and clock drift follow it."""
    decode_endpoint: type[DecodeEndpoint] = DecodeEndpoint
    prefill_endpoint: type[PrefillEndpoint] = PrefillEndpoint
    """The endpoint classes every rank runs (tests/sim/test_planted_bugs.py plants a bug in a subclass)."""

    @property
    def profile(self) -> FaultProfile:
        if self.fault_profile is not None:
            return self.fault_profile
        if self.faults not in FAULT_LEVELS:
            raise ConfigError(f"--faults {self.faults!r} is unknown; use one of {', '.join(FAULT_LEVELS)}")
        return FAULT_LEVELS[self.faults]


@dataclass(frozen=True, slots=True)
class Topology:
    """Model head count and attention kind, and the TP size of each prefill and each decode instance."""

    kv_heads: int
    prefill_tp: tuple[int, ...]
    decode_tp: tuple[int, ...]
    attention: Literal["gqa", "mla"] = "gqa"


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """One request: where it goes, how long it is, when it arrives, and whether and how it is aborted."""

    room: str
    key: int
    prefill: int
    decode: int
    num_tokens: int
    prefix_tokens: int
    arrival: float
    deadline: float
    abort_at: float | None
    abort_side: str | None


@dataclass(frozen=True, slots=True)
class Scenario:
    layout: KVLayout
    topology: Topology
    rooms: tuple[RoomPlan, ...]
    ring_bytes: tuple[int, ...]
    """Staging capacity of every rank of each decode instance."""
    prefill_pages: int
    decode_pages: int


def _valid_tps(heads: int) -> list[int]:
    return [tp for tp in TP_CHOICES if (tp <= heads and heads % tp == 0) or (tp > heads and tp % heads == 0)]


def make_topology(rng: random.Random, config: SimConfig) -> Topology:
    mla = config.kv_heads is None and rng.random() < config.mla_fraction
    # MLA's latent KV is one "head" that every TP rank holds whole
    heads = 1 if mla else config.kv_heads if config.kv_heads is not None else rng.choice(HEAD_CHOICES)
    tps = _valid_tps(heads)
    num_decode = rng.choice((1, 2))
    decode = tuple(config.decode_tp or rng.choice(tps) for _ in range(num_decode))
    if config.prefill_tp is not None:
        prefill: tuple[int, ...] = (config.prefill_tp, config.prefill_tp)
    else:
        others = [tp for tp in tps if tp != decode[0]] or tps
        # one staging instance (a TP size other than decode's, when the head count allows) and one drawn freely,
        # which matches a decode TP (the direct path) about half the time
        prefill = (rng.choice(others), rng.choice(tps))
    for tp in (*prefill, *decode):
        heads_of_rank(heads, tp, 0)  # raises ConfigError with the reason for an invalid pinned combination
    return Topology(heads, prefill, decode, "mla" if mla else "gqa")


def _max_region(layout: KVLayout, topology: Topology, decode_tp: int, chunk_tokens: int) -> int:
    return max(plan_staging(layout, p, decode_tp, 0, chunk_tokens).total_bytes for p in topology.prefill_tp)


def make_scenario(rng: random.Random, config: SimConfig) -> Scenario:
    """Draw a topology and the rooms of one run."""
    profile = config.profile
    topology = make_topology(rng, config)
    layout = KVLayout(config.num_layers, topology.kv_heads, config.head_dim, "bfloat16", config.page_size)
    ring_bytes = tuple(
        max(1, int(profile.ring_chunks * _max_region(layout, topology, d, config.chunk_tokens)))
        for d in topology.decode_tp
    )
    max_tokens = config.max_chunks * config.chunk_tokens + MAX_PREFIX_PAGES * config.page_size
    pages_per_room = pages_for(max_tokens, config.page_size)
    rooms: list[RoomPlan] = []
    arrival = 0.0
    for index in range(config.rooms):
        arrival += rng.expovariate(1 / 0.04)
        num_tokens = rng.randint(1, config.max_chunks * config.chunk_tokens)
        prefix = 0
        if rng.random() < config.prefix_fraction:
            prefix = config.page_size * rng.randint(1, MAX_PREFIX_PAGES)
            num_tokens += prefix
        budget = config.room_budget
        if profile.tight_deadlines and rng.random() < profile.tight_deadlines:
            budget = rng.uniform(0.01, 0.15)
        abort_at: float | None = None
        abort_side: str | None = None
        if profile.abort_rooms and rng.random() < profile.abort_rooms:
            abort_at = arrival + rng.expovariate(1 / 0.01)
            abort_side = rng.choice(("decode", "prefill"))
        rooms.append(
            RoomPlan(
                room=f"r{index}",
                key=rng.getrandbits(32),
                prefill=rng.randrange(len(topology.prefill_tp)),
                decode=rng.randrange(len(topology.decode_tp)),
                num_tokens=num_tokens,
                prefix_tokens=prefix,
                arrival=arrival,
                deadline=arrival + budget,
                abort_at=abort_at,
                abort_side=abort_side,
            )
        )
    # pools hold a few rooms at once, so rooms queue for KV pages on both sides (capacity limits, R11)
    return Scenario(
        layout,
        topology,
        tuple(rooms),
        ring_bytes,
        config.prefill_pool_rooms * pages_per_room,
        config.decode_pool_rooms * pages_per_room,
    )
