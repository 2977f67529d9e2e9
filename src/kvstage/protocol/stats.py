"""Counters of one endpoint, for metrics (runtime/ exports them) and for tests and the simulator.

Owns `EndpointStats`. Every rejected frame or message, dropped stale notice, retry, duplicate and room outcome
is counted here, so a failure is never silent. Called by decode.py / prefill.py (increment) and by runtime/,
sim/ and tests (read `snapshot()`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class EndpointStats:
    """Mutable counters; `snapshot()` flattens them to `{name: int}` with `failures.<reason>` and
    `rejected.<why>` keys."""

    frames_rejected: int = 0  # ReceivedFrame that failed to decode (ProtocolError)
    messages_rejected: Counter[str] = field(default_factory=Counter)  # valid frames refused, by why
    stale_dropped: int = 0  # stale epoch / fenced or superseded incarnation
    duplicates: int = 0  # idempotent re-deliveries answered again or ignored
    retries: int = 0  # request re-sends (R4)
    refusals_sent: int = 0  # GrantRefused sent
    refusals_received: int = 0  # GrantRefused received
    sends_failed: int = 0  # SendFailed events
    peers_dead: int = 0  # peers declared dead (R8)
    own_stalls: int = 0  # heartbeat ticks that came a heartbeat period late: this endpoint was stalled (R8)
    peers_restarted: int = 0  # newer incarnation seen (restart or re-epoch)
    lease_waits: int = 0  # prefill: a writable chunk parked because its decode peer's lease had lapsed
    quarantine_timers: int = 0  # decode: a restarted writer's rooms held until its old writes cannot land
    rooms_opened: int = 0
    rooms_succeeded: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # by reasons.FAILURE_REASONS

    def reject(self, why: str) -> None:
        self.messages_rejected[why] += 1

    def snapshot(self) -> dict[str, int]:
        out = {
            "frames_rejected": self.frames_rejected,
            "messages_rejected": sum(self.messages_rejected.values()),
            "stale_dropped": self.stale_dropped,
            "duplicates": self.duplicates,
            "retries": self.retries,
            "refusals_sent": self.refusals_sent,
            "refusals_received": self.refusals_received,
            "sends_failed": self.sends_failed,
            "peers_dead": self.peers_dead,
            "own_stalls": self.own_stalls,
            "peers_restarted": self.peers_restarted,
            "lease_waits": self.lease_waits,
            "quarantine_timers": self.quarantine_timers,
            "rooms_opened": self.rooms_opened,
            "rooms_succeeded": self.rooms_succeeded,
            "rooms_failed": sum(self.failures.values()),
        }
        out.update({f"failures.{reason}": n for reason, n in self.failures.items()})
        out.update({f"rejected.{why}": n for why, n in self.messages_rejected.items()})
        return out
