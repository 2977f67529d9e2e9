"""`RouterConfig`: everything one router is told at its start (the `kvstage router` flags, docs/vllm.md "Router").

Invariants: frozen; the keys and the secret are left out of its repr, so logging a config never shows them.
Called by `kvstage router` (cli.py), `router.app`, `router.proxy` and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstage.router.instances import Instance, Role
from kvstage.router.select import POLICIES


@dataclass(frozen=True)
class RouterConfig:
    bootstrap: str
    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]
    max_concurrent: int = 256
    max_body_bytes: int = 8 * 2**20
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence from decode while it answers
    prefill_timeout_s: float = 300.0  # whole prefill request
    health_timeout_s: float = 2.0  # one /health probe, and a /v1/models request
    probe_interval_s: float = 2.0  # how often every instance's /health is probed
    max_attempts: int = 3  # decode instances one request may be tried on, each with a new room
    breaker_failures: int = 3  # failures in a row that open an instance's circuit breaker
    breaker_cooldown_s: float = 10.0  # how long an open breaker keeps its instance out, before one trial request
    bootstrap_timeout_s: float = 2.0
    tp_refresh_s: float = 30.0  # how often a known instance's TP size is looked up again
    tp_retry_s: float = 1.0  # how often the TP size of an instance never found is looked up again
    secret: bytes | None = field(default=None, repr=False)  # the deployment's shared secret, for the bootstrap
    api_key: str | None = field(default=None, repr=False)  # what clients must send as `Authorization: Bearer`
    upstream_api_key: str | None = field(default=None, repr=False)  # what the router sends to vLLM (its --api-key)
    discover: bool = False  # follow the instances registered with the bootstrap (router.discovery)
    discover_poll_s: float = 1.0  # how often the bootstrap is asked for changes
    policy: str = "round_robin"  # router.select.POLICIES
    prefix_block_tokens: int = 128  # prefix policy: tokens per block (vLLM's block size)
    prefix_balance: float = 1.25  # prefix policy: no decode takes more than this times the average load ...
    prefix_slack: int = 4  # ... plus this many requests

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.prefix_block_tokens < 1 or not self.prefix_balance >= 1.0 or self.prefix_slack < 0:
            raise ValueError(
                "prefix_block_tokens must be positive, prefix_balance at least 1, prefix_slack not negative"
            )
        if not (self.discover or (self.prefill and self.decode)):
            raise ValueError("without discovery, at least one prefill and one decode instance are needed")

    def instances(self, role: Role) -> tuple[Instance, ...]:
        """The instances configured for `role`."""
        return self.prefill if role == "prefill" else self.decode
