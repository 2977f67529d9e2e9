"""The connector's settings: what goes in vLLM's `kv_transfer_config.kv_connector_extra_config`.

Owns `ConnectorSettings`, parsed and checked once per process from the extra config, with every unknown key and
every bad value refused by name (a typo in a deployment file fails at start, not at the first request). Pure
values; called by the connector's scheduler and worker sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from kvstage.errors import ConfigError
from kvstage.layout import ceil_div
from kvstage.protocol import Timing

BACKENDS = ("local", "cuda_ipc", "mooncake", "nixl")
_KINDS: dict[str, type] = {"str": str, "int": int, "float": float}


def _is_base_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and len(url) <= 512


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """One vLLM instance's kvstage settings (the same on every rank of the instance).

    - `instance`: this instance's name; the router and the peer instance address it by this name.
    - `bootstrap`: the directory every rank registers with: `kvstage bootstrap` (`tcp://HOST:PORT`) or etcd
      (`etcd://HOST:PORT[/NAMESPACE][?lease_s=N]`, docs/directory.md).
    - `backend`: the data transport, "local" (same host, host memory), "cuda_ipc" (same host, GPU memory),
      "mooncake" or "nixl" (across hosts; nixl moves GPU memory too). With KV on a GPU, cuda_ipc and nixl put the
      staging on that GPU; the others stage through host memory (the fallback, named in the log at start).
    - `host`: the address peers reach this instance's ranks at (control plane and transport).
    - `chunk_tokens`: the staging grid; 0 picks the smallest multiple of the block size that is at least 256.
    - `ring_mib` (decode) / `staging_mib` (prefill): staging memory per rank.
    - `room_timeout_s`: a request's KV handoff ends, with success or a stated failure, by this deadline.
    - `dead_after_s`: a peer rank silent this long is dead (its rooms fail, vLLM recomputes). Longer than the
      protocol's 5 s default: a vLLM worker can be unresponsive for seconds (compilation, a TP rank scheduled
      late on a busy CPU host), and a false "peer dead" costs a recompute.
    - `decode_dead_after_s` (prefill): a decode rank silent this long is dead: its rooms fail and vLLM frees the
      blocks prefill held for them. Shorter than `dead_after_s`, because blocks held for a dead decode are blocks
      no new prompt can use (in vLLM's sequential flow prefill holds a finished request's blocks until decode takes
      its KV), and because nothing of decode's lands in prefill's memory, so no quarantine bounds it from below. A
      decode rank declared dead while alive (its agent's thread stalled this long) loses its rooms with this
      prefill: decode recomputes those prompts. Heartbeats go every `heartbeat_s` seconds (below), both ways.
    - `claim_timeout_s` (prefill, vLLM's sequential flow): once prefill has computed a prompt, it holds the blocks
      this long at most for a decode rank to take the room; then the room fails ("unclaimed") and vLLM frees them.
      A decode request that never came (the proxy dropped it, decode's vLLM refused it) costs its prompt's blocks
      this long, not `room_timeout_s`. Raise it where decode's queue can keep a request waiting longer: decode
      takes the room when its scheduler admits the request, and a room taken after this recomputes on decode.
    - `report_dir`: when set, each rank appends per-page digests of the KV it sent or received, and its
      transfer counters, to a file there (the demo's checks). Off by default: it reads every byte once more.
    - `url`: this instance's OpenAI base URL as clients reach it (`http://HOST:PORT`), published with its ranks'
      bootstrap records so that `kvstage router --discover` finds it; "" publishes none (a router with static
      instance lists needs none).
    - `ring_canary` (decode): 1 keeps the ring's free bytes filled with a canary and checks it at every
      allocation and free; a byte found written counts as `kvstage_ring_canary_violations_total` (a write landed
      after its room released the space). A diagnostic (tests, a deployment under suspicion); 0, off, by default.
    - `secret_file`: a file holding the deployment's shared secret (else `KVSTAGE_SECRET`, else none): every
      control frame and bootstrap request is then authenticated (docs/security.md). Needed when `host` is not a
      loopback address.
    """

    instance: str
    bootstrap: str = "tcp://127.0.0.1:7100"
    backend: str = "local"
    host: str = "127.0.0.1"
    chunk_tokens: int = 0
    ring_mib: int = 256
    staging_mib: int = 64
    room_timeout_s: float = 120.0
    dead_after_s: float = 20.0
    decode_dead_after_s: float = 4.0
    claim_timeout_s: float = 30.0
    report_dir: str = ""
    secret_file: str = ""
    url: str = ""
    ring_canary: int = 0

    def __post_init__(self) -> None:
        if self.url and not _is_base_url(self.url):
            raise ConfigError(f"kvstage: 'url' must be http(s)://HOST:PORT (the OpenAI server), got {self.url!r}")
        if not self.instance or "/" in self.instance:
            raise ConfigError(f"kvstage: 'instance' must be a non-empty name without '/', got {self.instance!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"kvstage: 'backend' must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("ring_mib", "staging_mib"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kvstage: {name!r} must be positive, got {getattr(self, name)!r}")
        if self.ring_canary not in (0, 1):
            raise ConfigError(f"kvstage: 'ring_canary' must be 0 or 1, got {self.ring_canary!r}")
        if self.chunk_tokens < 0:
            raise ConfigError(f"kvstage: 'chunk_tokens' must be 0 (automatic) or positive, got {self.chunk_tokens}")
        for name in ("room_timeout_s", "dead_after_s", "decode_dead_after_s", "claim_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"kvstage: {name!r} must be positive, got {getattr(self, name)!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"kvstage: unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}")
        if "instance" not in extra:
            raise ConfigError("kvstage: kv_connector_extra_config needs 'instance' (this vLLM instance's name)")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = _KINDS[str(known[name].type)]
            try:
                values[name] = kind(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"kvstage: {name!r} must be a {kind.__name__}, got {value!r}") from exc
        return cls(**values)

    @property
    def heartbeat_s(self) -> float:
        """How often a rank heartbeats each peer: often enough for `dead_after_s` (10 per period) and for a prefill's
        `decode_dead_after_s` of the same value as this instance's (8 per period)."""
        return min(self.dead_after_s / 10, self.decode_dead_after_s / 8)

    def timing(self) -> Timing:
        """The protocol timing of this instance's ranks."""
        return Timing(heartbeat_s=self.heartbeat_s, dead_after_s=self.dead_after_s,
                      decode_dead_after_s=self.decode_dead_after_s)  # fmt: skip

    def chunk_tokens_for(self, block_size: int) -> int:
        """The staging grid for vLLM's block size: the setting, or the smallest block multiple >= 256 tokens."""
        if self.chunk_tokens:
            if self.chunk_tokens % block_size:
                raise ConfigError(
                    f"kvstage: chunk_tokens={self.chunk_tokens} must be a multiple of vLLM's block size {block_size}"
                )
            return self.chunk_tokens
        return block_size * max(1, ceil_div(256, block_size))
