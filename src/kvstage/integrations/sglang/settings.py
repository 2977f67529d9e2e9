"""The sglang backend's settings, read once per process from `KVSTAGE_*` environment variables.

Owns `BackendSettings` and `settings_from_env`. sglang's command line has no room for a backend's own options, so
they come from the environment, the same on every rank of an instance; an unknown value is refused by name at start
(a typo fails the server's start, not its first request). Pure values; called by manager.py and bootstrap.py.

| variable | meaning | default |
|---|---|---|
| `KVSTAGE_BOOTSTRAP` | kvstage's directory, one per deployment (`kvstage bootstrap` or etcd) | `tcp://127.0.0.1:7100` |
| `KVSTAGE_BACKEND` | data transport: local, mooncake, nixl, cuda_ipc | `local` |
| `KVSTAGE_HOST` | the address peers reach this rank's control plane and transport at | `127.0.0.1` |
| `KVSTAGE_CHUNK_TOKENS` | decode's staging grid (a multiple of the page size; 0: the smallest multiple >= 256) | 0 |
| `KVSTAGE_RING_MIB` / `KVSTAGE_STAGING_MIB` | decode ring / prefill staging per rank | 256 / 64 |
| `KVSTAGE_ROOM_TIMEOUT_S` | a request's handoff ends, with success or a stated failure, by this deadline | 120 |
| `KVSTAGE_INSTANCE` | this instance's name in the directory | `sglang-{role}-{host}-{bootstrap port}` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvstage.errors import ConfigError

BACKENDS = ("local", "mooncake", "nixl", "cuda_ipc")


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """One instance's kvstage settings (see the module's table)."""

    bootstrap: str = "tcp://127.0.0.1:7100"
    backend: str = "local"
    host: str = "127.0.0.1"
    chunk_tokens: int = 0
    ring_mib: int = 256
    staging_mib: int = 64
    room_timeout_s: float = 120.0
    instance: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"KVSTAGE_BACKEND={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.chunk_tokens < 0 or self.ring_mib < 1 or self.staging_mib < 1:
            raise ConfigError("KVSTAGE_CHUNK_TOKENS must be >= 0 and KVSTAGE_RING_MIB, KVSTAGE_STAGING_MIB >= 1")
        if not self.room_timeout_s > 0:
            raise ConfigError(f"KVSTAGE_ROOM_TIMEOUT_S must be positive, got {self.room_timeout_s}")

    def grid(self, page_size: int) -> int:
        """The staging grid in tokens: `chunk_tokens`, or the smallest multiple of `page_size` that is >= 256."""
        if self.chunk_tokens:
            if self.chunk_tokens % page_size:
                raise ConfigError(f"KVSTAGE_CHUNK_TOKENS={self.chunk_tokens} is not a multiple of the page size")
            return self.chunk_tokens
        return -(-256 // page_size) * page_size


def _number(env: Mapping[str, str], name: str, kind: type[int] | type[float], default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a {kind.__name__}") from None


def settings_from_env(env: Mapping[str, str] | None = None) -> BackendSettings:
    """The settings in `env` (default: `os.environ`); `ConfigError` names a bad value."""
    env = os.environ if env is None else env
    base = BackendSettings()
    return BackendSettings(
        bootstrap=env.get("KVSTAGE_BOOTSTRAP", base.bootstrap),
        backend=env.get("KVSTAGE_BACKEND", base.backend),
        host=env.get("KVSTAGE_HOST", base.host),
        chunk_tokens=int(_number(env, "KVSTAGE_CHUNK_TOKENS", int, base.chunk_tokens)),
        ring_mib=int(_number(env, "KVSTAGE_RING_MIB", int, base.ring_mib)),
        staging_mib=int(_number(env, "KVSTAGE_STAGING_MIB", int, base.staging_mib)),
        room_timeout_s=_number(env, "KVSTAGE_ROOM_TIMEOUT_S", float, base.room_timeout_s),
        instance=env.get("KVSTAGE_INSTANCE", base.instance),
    )
