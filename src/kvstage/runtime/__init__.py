"""kvstage.runtime: the agents that run the sans-I/O protocol for real (threads, sockets, transports, clocks).

`DecodeAgent` (decode.py) and `PrefillAgent` (prefill.py), built on `BaseAgent` (agent.py, with its peer tables
in peers.py), are what an engine embeds, each run by one reactor thread (reactor.py); `AgentMetrics`
(metrics.py) is their Prometheus registry; `Resolver` (directory.py) keeps their view of peers fresh from the
bootstrap service.
docs/integration.md shows how an engine plugs in. Imports point down only: runtime/ uses protocol/,
transport/, dataplane/ and the pure core, and nothing below imports runtime/.
"""

from kvstage.runtime.config import AgentConfig, AgentSnapshot, RoomOutcome, peer_id
from kvstage.runtime.decode import DecodeAgent
from kvstage.runtime.metrics import AgentMetrics, BusyClock
from kvstage.runtime.prefill import PrefillAgent

__all__ = [
    "AgentConfig",
    "AgentMetrics",
    "AgentSnapshot",
    "BusyClock",
    "DecodeAgent",
    "PrefillAgent",
    "RoomOutcome",
    "peer_id",
]
