"""Static configuration of the protocol endpoints: timing, caps, and each side's identity and layout.

Owns: `Timing` (heartbeats, liveness, retry backoff, the writer lease), `quarantine` (how long a writer's writes
may land after decode last heard it), `lease_gaps` (whether a decode rank's timing covers a writer's lease, across
two instances configured apart), `Limits` (per-peer caps that keep state bounded, R10), `DecodeConfig` and
`PrefillConfig`. Validation happens here, at construction, so an endpoint never starts with a configuration it
cannot serve (R12: staging requires `validate_staging_config` to pass).

Called by: runtime/ and sim/ (build), decode.py / prefill.py (read). Pure values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from kvstage.errors import ConfigError
from kvstage.layout import KVLayout, heads_of_rank, validate_staging_config
from kvstage.protocol.messages import MAX_AUX_BYTES, MAX_PEER_ID_LEN, MAX_TP

#: `Timing.lease_s` and `Timing.max_write_s` left at 0 become this share of `dead_after_s` each.
LEASE_SHARE: Final = 0.45


def quarantine(lease_s: float, max_write_s: float, drift: float) -> float:
    """How long after decode last heard a writer its writes may still land, in decode's clock: the lease and the
    write bound, stretched by both clocks' drift (docs/protocol.md, "Writer leases")."""
    return (lease_s + max_write_s) * (1 + drift) / (1 - drift)


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds, in the caller's clock. Defaults suit one host or one rack; every value must be positive.

    The writer lease (docs/protocol.md, "Writer leases"): a writer posts a write to a decode rank only within
    `lease_s` of sending a frame that rank has since echoed, and every posted write lands within `max_write_s` or
    never (the transport's bound, docs/transports.md). So a fenced writer's writes can land until at most
    `quarantine_s` after decode last heard from it, in decode's clock, whatever the two clocks read, as long as
    their rates differ by at most `clock_drift`. A peer is declared dead after `dead_after_s` of silence, so
    `dead_after_s >= quarantine_s` is required: a dead writer's ring space can then be reused at once.
    `lease_s` and `max_write_s` left at 0 become `LEASE_SHARE * dead_after_s` each.

    A prefill rank declares a silent decode rank dead after `decode_dead_after_s` (0: `dead_after_s`), which may be
    much shorter: nothing of decode's lands in prefill's memory, so no quarantine bounds it from below. Then a room
    whose decode died frees prefill's KV within seconds instead of holding it to the room's deadline; a decode rank
    declared dead while alive (stalled longer than that) loses its rooms with that prefill rank (decode recomputes),
    never a byte."""

    heartbeat_s: float = 0.5  # both directions; decode heartbeats also carry the watermark (R4, R8)
    dead_after_s: float = 5.0  # a peer silent this long is dead (R8)
    retry_initial_s: float = 0.05  # first retry of an unanswered request (R4)
    retry_max_s: float = 1.0  # backoff doubles up to this
    lease_s: float = 0.0  # a writer's lease towards a decode rank, counted from its last echoed frame
    max_write_s: float = 0.0  # the longest a posted write may take to land (or fail): the transport's bound
    clock_drift: float = 0.001  # the largest relative rate difference between two peers' clocks
    decode_dead_after_s: float = 0.0  # prefill side: a decode rank silent this long is dead (0: dead_after_s)

    def __post_init__(self) -> None:
        self._derive()
        for problem in self.problems():
            raise ConfigError(problem)

    @classmethod
    def unchecked(cls, **fields: float) -> Timing:
        """A Timing built without `problems()` checked: for tests that plant a bad configuration on purpose."""
        timing = object.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(timing, f.name, fields.get(f.name, f.default))
        timing._derive()
        return timing

    def _derive(self) -> None:
        for name in ("lease_s", "max_write_s"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, LEASE_SHARE * self.dead_after_s)
        if self.decode_dead_after_s == 0:
            object.__setattr__(self, "decode_dead_after_s", self.dead_after_s)

    @property
    def quarantine_s(self) -> float:
        """How long after decode last heard from a writer one of its writes may still land, in decode's clock."""
        return quarantine(self.lease_s, self.max_write_s, self.clock_drift)

    def problems(self) -> list[str]:
        """Why this timing is unsafe or unworkable (empty when it is fine)."""
        positive = [f.name for f in dataclasses.fields(self) if f.name != "clock_drift"]
        bad = [
            f"Timing.{name} must be positive, got {getattr(self, name)!r}"
            for name in positive
            if not getattr(self, name) > 0
        ]
        if bad:
            return bad
        if not 0 <= self.clock_drift < 0.5:
            return [f"Timing.clock_drift must be in [0, 0.5), got {self.clock_drift!r}"]
        bad.extend(
            f"Timing.{name}={getattr(self, name)} must exceed heartbeat_s={self.heartbeat_s}, "
            "or live peers are declared dead between two heartbeats"
            for name in ("dead_after_s", "decode_dead_after_s")
            if getattr(self, name) <= self.heartbeat_s
        )
        if self.lease_s < 2 * self.heartbeat_s:
            bad.append(
                f"Timing.lease_s={self.lease_s} must be at least 2 * heartbeat_s={self.heartbeat_s}: a lease is "
                "renewed by the peer's frames, and a heartbeat's round trip takes up to two heartbeat periods"
            )
        if self.dead_after_s < self.quarantine_s:
            bad.append(
                f"Timing.dead_after_s={self.dead_after_s} must be at least (lease_s + max_write_s) * (1 + drift) / "
                f"(1 - drift) = {self.quarantine_s:.6g} (lease_s={self.lease_s}, max_write_s={self.max_write_s}, "
                f"clock_drift={self.clock_drift}): a writer declared dead could otherwise still land a write in "
                "ring space that was reused"
            )
        return bad


class LeaseTerms(Protocol):
    """The lease-relevant part of one rank's timing: a `Timing`, or a peer's as its bootstrap record carries it."""

    @property
    def dead_after_s(self) -> float: ...
    @property
    def lease_s(self) -> float: ...
    @property
    def max_write_s(self) -> float: ...
    @property
    def clock_drift(self) -> float: ...


def lease_gaps(decode: LeaseTerms, writer: LeaseTerms) -> list[str]:
    """Why a decode rank with `decode`'s timing may reuse ring space that a writer with `writer`'s timing can
    still write into (empty when it cannot; docs/protocol.md, "Writer leases"). `Timing.problems()` checks one
    rank's own values; two instances configured apart must also agree. The writer's writes land within
    `need = (writer.lease_s + writer.max_write_s)(1 + d)/(1 - d)` of decode last hearing from it, `d` the larger
    `clock_drift` of the two. Decode frees a dead writer's space at once after its own `dead_after_s`, and a
    restarted writer's at its own `quarantine_s` (from its own `lease_s`, `max_write_s` and `clock_drift`): both
    must be at least `need`."""
    drift = max(decode.clock_drift, writer.clock_drift)
    need = quarantine(writer.lease_s, writer.max_write_s, drift)
    own = quarantine(decode.lease_s, decode.max_write_s, decode.clock_drift)
    terms = (
        f"the writer's quarantine {need:.6g} = (lease_s={writer.lease_s} + max_write_s={writer.max_write_s}) * "
        f"(1 + drift) / (1 - drift) with drift={drift}, the larger clock_drift of the two"
    )
    gaps = []
    if decode.dead_after_s < need:
        gaps.append(
            f"decode's Timing.dead_after_s={decode.dead_after_s} is less than {terms}: decode would declare the "
            "writer dead and reuse its ring space while a write under its lease can still land; raise decode's "
            f"Timing.dead_after_s to at least {need:.6g}, or lower the writer's Timing.lease_s and max_write_s "
            f"(they default to {LEASE_SHARE} * its dead_after_s={writer.dead_after_s})"
        )
    if own < need:
        gaps.append(
            f"decode's Timing.quarantine_s={own:.6g} (lease_s={decode.lease_s} + max_write_s={decode.max_write_s}, "
            f"clock_drift={decode.clock_drift}) is less than {terms}: after the writer restarts, decode would reuse "
            "its ring space while the old process's writes can still land; raise decode's Timing.lease_s and "
            f"max_write_s (they default to {LEASE_SHARE} * its dead_after_s) until its quarantine_s is at least "
            f"{need:.6g}, or lower the writer's"
        )
    return gaps


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps that bound every table an inbound message could grow (R10, B1)."""

    max_peers: int = 1024  # peers known at once
    max_fences: int = 65536  # fence records still needed (each released by rule); at the cap new peers wait
    max_rooms_per_peer: int = 4096  # open rooms shared with one peer (prefill: incl. metadata not attached yet)
    max_chunks_ahead: int = 4  # per (room, decode rank): chunks requested but not yet written (R11); this also
    # bounds parked chunks per peer to max_rooms_per_peer * max_chunks_ahead (R9, R10)
    max_closed_rooms: int = 65536  # remembered recently closed rooms (answers "room closed" instead of "unknown")
    max_pending_pages: int = 2**22  # prefill: page ids of all Metadata waiting for their room's attach (decoded,
    # about 40 bytes each: 160 MiB); beyond: Abort("overloaded")
    max_aux_bytes: int = 256 * 2**10  # a room's aux row (KVReady.aux, ChunkReady.aux), at most MAX_AUX_BYTES; decode
    # holds one per open room

    def __post_init__(self) -> None:
        names = ("max_peers", "max_fences", "max_rooms_per_peer", "max_chunks_ahead", "max_closed_rooms",
                 "max_pending_pages", "max_aux_bytes")  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"Limits.{name} must be a positive integer, got {value!r}")
        if self.max_aux_bytes > MAX_AUX_BYTES:
            raise ConfigError(f"Limits.max_aux_bytes={self.max_aux_bytes} exceeds the wire's bound {MAX_AUX_BYTES}")


def _check_identity(peer_id: str, tp_size: int, rank: int, layout: KVLayout) -> None:
    if not 0 < len(peer_id) <= MAX_PEER_ID_LEN:
        raise ConfigError(f"peer_id must have 1..{MAX_PEER_ID_LEN} characters, got {peer_id!r}")
    if not 1 <= tp_size <= MAX_TP:
        raise ConfigError(f"tp_size={tp_size} must be in 1..{MAX_TP}")
    heads_of_rank(layout.num_kv_heads, tp_size, rank)  # raises ConfigError for a bad (H, tp, rank)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """One decode rank: `rank` of a TP group of `tp_size`, its ring of `ring_bytes`, and the chunk grid.

    `attention="mla"`: the layout is an MLA model's latent cache, one head every rank holds whole
    (`layout.latent_layout`), so every room can take the direct path, whatever the two TP sizes (R12).
    `staged_only` makes every room stage, matched TP and MLA too: for a rank whose KV writers cannot reach page to
    page (an engine's own KV that its transport does not export, or on a GPU); `ExpectRoom.direct=False` does it
    for one room. Staging rooms need `validate_staging_config` to pass."""

    peer_id: str
    layout: KVLayout
    tp_size: int
    rank: int
    chunk_tokens: int
    ring_bytes: int
    ring_alignment: int = 1
    attention: Literal["mha", "gqa", "mla"] = "gqa"
    timing: Timing = field(default_factory=Timing)
    limits: Limits = field(default_factory=Limits)
    staged_only: bool = False

    def __post_init__(self) -> None:
        _check_identity(self.peer_id, self.tp_size, self.rank, self.layout)
        if self.attention == "mla" and self.layout.num_kv_heads != 1:
            raise ConfigError(
                f"attention='mla' needs a layout of one KV head (the latent row, layout.latent_layout), got "
                f"num_kv_heads={self.layout.num_kv_heads}"
            )
        validate_staging_config(
            chunk_tokens=self.chunk_tokens, page_size=self.layout.page_size, attention=self.attention
        )
        if self.ring_bytes <= 0 or self.ring_alignment <= 0 or self.ring_bytes % self.ring_alignment:
            raise ConfigError(
                f"ring_bytes={self.ring_bytes} must be a positive multiple of ring_alignment={self.ring_alignment}"
            )


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """One prefill rank: `rank` of a TP group of `tp_size`. The chunk grid comes from each room's Metadata."""

    peer_id: str
    layout: KVLayout
    tp_size: int
    rank: int
    timing: Timing = field(default_factory=Timing)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        _check_identity(self.peer_id, self.tp_size, self.rank, self.layout)
