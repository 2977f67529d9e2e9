"""The values an engine hands an agent and gets back: `AgentConfig`, `RoomOutcome`, `AgentSnapshot`, `peer_id`, and
`check_peer`, the check that a peer's bootstrap record is one this agent can work with.

Owns these frozen values and that pure check (no I/O, no threads), so that engines, tests and the agents share one
definition. Called by the engine integrations (kvstage.integrations), the runtime agents (agent.py, decode.py,
prefill.py), the bench and the demos.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvstage.errors import ConfigError
from kvstage.layout import Attention, KVLayout
from kvstage.protocol import Limits, Timing
from kvstage.protocol.aux import check_aux_fits
from kvstage.protocol.codec import DEFAULT_MAX_FRAME_BYTES
from kvstage.protocol.config import lease_gaps
from kvstage.runtime.outbox import ParkLimits
from kvstage.transport.bootstrap import LayoutRecord, PeerRecord, TimingRecord, check_compatible
from kvstage.transport.control import ChannelConfig
from kvstage.transport.data import TransportConfig


def peer_id(instance: str, rank: int) -> str:
    """The peer id of `rank` of `instance`: what engines pass as `prefill_peers`, and what the bootstrap keys on."""
    return f"{instance}/{rank}"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """One rank's agent. Decode needs `chunk_tokens` and `ring_bytes`; prefill uses `staging_bytes`."""

    instance: str
    rank: int
    tp_size: int
    layout: KVLayout
    bootstrap: str
    #: "mla" when `layout` is an MLA model's latent cache (`layout.latent_layout`); decode's rooms may then go direct
    #: whatever the two TP sizes (`DecodeConfig.attention`)
    attention: Attention = "gqa"
    transport: TransportConfig = field(default_factory=TransportConfig)
    control_bind: str = "tcp://127.0.0.1:*"
    #: Shared secret of the deployment (`kvstage.transport.auth.load_secret`): every control frame and bootstrap
    #: request is then authenticated. Without one, `control_bind` must be a loopback address unless `insecure`.
    secret: bytes | None = field(default=None, repr=False)
    insecure: bool = False
    timing: Timing = field(default_factory=Timing)
    limits: Limits = field(default_factory=Limits)
    channel: ChannelConfig = field(default_factory=lambda: ChannelConfig(max_frame_bytes=DEFAULT_MAX_FRAME_BYTES))
    chunk_tokens: int = 0
    ring_bytes: int = 0
    ring_alignment: int = 64
    #: Decode: keep the ring's free bytes filled with a canary and check it (kvstage.runtime.canary): a diagnostic.
    ring_canary: bool = False
    staging_bytes: int = 64 * 2**20
    #: Prefill: writes in flight per decode peer; more wait in order (see PrefillAgent._enqueue_write).
    writes_per_peer: int = 2
    #: Sends parked for peers not resolved yet; `park.ttl_s` also bounds how long the resolver asks for a peer
    #: that never registers.
    park: ParkLimits = field(default_factory=ParkLimits)
    resolve_refresh_s: float = 1.0
    #: How long one bootstrap request (lookup or registration) may take before it is retried. On a starved host a
    #: short timeout makes every lookup fail in a loop while sends to unresolved peers wait.
    bootstrap_timeout_s: float = 5.0
    #: Chunk stage stamps kept for `kvstage bench`'s breakdown (runtime/trace.py); 0 (the default) records none.
    trace_chunks: int = 0
    #: The instance's OpenAI base URL, published in the record for routers that discover instances ("": none).
    url: str = ""

    def __post_init__(self) -> None:
        if not self.bootstrap_timeout_s > 0:
            raise ConfigError(f"bootstrap_timeout_s must be positive, got {self.bootstrap_timeout_s!r}")
        check_aux_fits(self.limits.max_aux_bytes, self.channel.max_frame_bytes)
        bound = self.transport.max_write_s
        if bound is not None and bound > self.timing.max_write_s:
            raise ConfigError(
                f"transport.max_write_s={bound} exceeds timing.max_write_s={self.timing.max_write_s}: decode's "
                "quarantine (docs/protocol.md, R13) assumes every write lands within the timing's bound"
            )

    @property
    def peer_id(self) -> str:
        return peer_id(self.instance, self.rank)

    @property
    def bounded_transport(self) -> TransportConfig:
        """The transport configuration with every write's lifetime bounded by `timing.max_write_s` (R13)."""
        if self.transport.max_write_s is not None:
            return self.transport
        return replace(self.transport, max_write_s=self.timing.max_write_s)

    def record(self, role: str, control_address: str, session: int, descriptors: dict[str, bytes]) -> PeerRecord:
        """What this rank publishes in the bootstrap, as `role`, reachable at `control_address`."""
        return PeerRecord(
            peer_id=self.peer_id,
            role=role,  # type: ignore[arg-type]
            instance=self.instance,
            tp_size=self.tp_size,
            rank=self.rank,
            layout=LayoutRecord.of(self.layout),
            control_address=control_address,
            backend=self.transport.backend,
            session=session,
            descriptors=descriptors,
            chunk_tokens=self.chunk_tokens,
            timing=TimingRecord(
                dead_after_s=self.timing.dead_after_s,
                lease_s=self.timing.lease_s,
                max_write_s=self.timing.max_write_s,
                clock_drift=self.timing.clock_drift,
            ),
            url=self.url,
        )


@dataclass(frozen=True, slots=True)
class RoomOutcome:
    """How a room ended. On a failed decode room, `pages` are the engine's pages, now free for it to reuse. On a
    decode room that succeeded, `aux` is the aux row prefill's engine gave with its last `kv_ready` (empty: none)."""

    room: int
    ok: bool
    reason: str = ""
    pages: tuple[int, ...] = ()
    aux: bytes = b""


@dataclass(frozen=True, slots=True)
class AgentSnapshot:
    """Read-only view the reactor refreshes every `REFRESH_S` (10 ms, runtime/agent.py); safe to read from any
    thread."""

    open_rooms: int = 0
    quiescent: bool = True
    ring_live_bytes: int = 0
    ring_high_water: int = 0
    writes_in_flight: int = 0
    writes_waiting: int = 0
    pending_sends: int = 0
    stats: dict[str, int] = field(default_factory=dict)


def check_peer(config: AgentConfig, role: str, peer_role: str, record: PeerRecord) -> None:
    """`ConfigError`, naming both sides, unless `record` is a `peer_role` rank this agent can work with: same KV
    layout (layers, heads, head_dim, dtype, page size), same data backend, and timings that keep the writer lease
    safe across the two instances (`lease_gaps` with the decode side's timing and the prefill side's: decode's
    `dead_after_s` and `quarantine_s` cover the writer's lease and write bound, docs/protocol.md "Writer leases")."""
    me = f"{role} rank {config.peer_id!r}"
    if record.role != peer_role:
        raise ConfigError(f"role mismatch: {record.peer_id!r} registered as {record.role}, expected a {peer_role} rank")
    check_compatible(config.layout, record, me=me)
    if record.backend != config.transport.backend:
        raise ConfigError(
            f"backend mismatch: {config.peer_id!r} uses {config.transport.backend!r}, "
            f"{record.peer_id!r} uses {record.backend!r}"
        )
    if record.timing is None:
        raise ConfigError(
            f"{record.role} rank {record.peer_id!r} publishes no timing, so {me} cannot check that the writer lease "
            'is safe between them (docs/protocol.md, "Writer leases"); every kvstage agent publishes it'
        )
    if role == "decode":
        gaps = lease_gaps(config.timing, record.timing)
        decode, writer = config.peer_id, record.peer_id
    else:
        gaps = lease_gaps(record.timing, config.timing)
        decode, writer = record.peer_id, config.peer_id
    if gaps:
        raise ConfigError(
            f"timing mismatch between decode rank {decode!r} and prefill rank {writer!r} (the writer): "
            + "; and ".join(gaps)
        )
