"""kvstage.protocol: the sans-I/O staging protocol between one decode rank and the prefill ranks writing to it.

Two endpoints, one per rank, each serving many peers and many rooms (rooms may mix TP pairs and paths):
`DecodeEndpoint` (owns a `StagingRing`) and `PrefillEndpoint`. Both are pure state machines: the caller feeds
an event and the current time, the endpoint returns the actions to carry out, in order. No I/O, no clock, no
randomness, no threads: the same code runs under runtime/ (real sockets and transports) and sim/ (seeded
faults).

    actions = endpoint.handle(event, now)      # every input goes through here
    actions = endpoint.tick(now)               # == handle(Tick(), now); call when now >= endpoint.next_timer()
    endpoint.next_timer() -> float | None      # earliest time a Tick has work (retry, heartbeat, deadline)
    endpoint.stats.snapshot() -> dict[str, int]  # counters for metrics and tests
    endpoint.open_rooms() -> frozenset[int]    # rooms not forgotten yet (incl. releasing / quarantined)
    endpoint.is_quiescent() -> bool            # no room, no retry, nothing parked or in flight (Q1)
    endpoint.rooms_with_timers() -> frozenset[int]  # rooms with a retry or deadline pending (Q1)
    endpoint.peers(), endpoint.pending_retries(), endpoint.room_state(room), endpoint.epoch_towards(peer_id)
    DecodeEndpoint.ring (read only); PrefillEndpoint.parked_count(), .pending_metadata()

Primitives and who calls them (events.py / actions.py have the fields):

| primitive                        | side    | called by / carried out by                                   |
|----------------------------------|---------|--------------------------------------------------------------|
| ExpectRoom(room, peers, ...)     | decode  | decode engine, before anything is sent for the room (R2)     |
| AttachRoom(room, ...)            | prefill | prefill engine, when it admits the room                      |
| ComputeScheduled(room, end)      | prefill | prefill engine, before a forward pass (staging asked, R11)   |
| KVReady(room, end, pages, aux)   | prefill | prefill engine, after a forward pass (aux: only the one that |
|                                  |         | completes the room; it rides the last chunk, aux.py)         |
| AbortRoom(room)                  | both    | the local engine                                             |
| Received / ReceivedFrame         | both    | runtime/sim, for each inbound message                        |
| Completion(token, ok, reason)    | both    | runtime/sim, answering WriteRegion / WriteDirect / Scatter / |
|                                  |         | FenceScatter actions                                         |
| SendFailed(peer, envelope)       | both    | runtime/sim, when a Send could not be carried out            |
| Tick                             | both    | runtime/sim timer                                            |
| -> Send(peer, envelope)          | both    | runtime: control socket; sim: simulated network              |
| -> WriteRegion / WriteDirect     | prefill | runtime: gather + one bulk write / page-to-page writes       |
| -> Scatter / FenceScatter        | decode  | runtime: scatter kernel / wait for the room's scatters       |
| -> FreePages(room, pages)        | decode  | the decode engine's KV pool (failure only)                   |
| -> FencePeer(peer, session, ep)  | both    | runtime: drop that incarnation's late writes and frames      |
| -> RoomSucceeded / RoomFailed    | both    | the local engine; RoomFailed.reason is one of reasons.py;    |
|                                  |         | decode's RoomSucceeded.aux is the room's aux row             |

Rules kept by construction (issue 3): R1 release on every terminal path, scatter fenced first, idempotent;
R2 register before announce, unknown room -> explicit GrantRefused; R3 failures scoped to one room, no
fallback; R4 every request retried with backoff until answered, idempotent handlers, watermark on every
decode->prefill envelope and on every heartbeat, a new incarnation gets it at once; R5 completion by arrival of
every writer's every chunk, any order, under a deadline; R6 abort acknowledged by prefill only when no write of
the room can land, decode quarantines ring space (and direct-path pages) until then; R7 epochs on grants and
incarnations on envelopes, stale ones dropped and counted; R8 heartbeats both ways, dead peers fenced and
pruned; R9 chunks wait for ring space parked per peer and re-checked on watermark moves; R10 every inbound
field checked against the room, unknown rooms allocate nothing, per-peer caps; R11 staging requested in chunk
order for chunks about to be computed, at most `Limits.max_chunks_ahead` ahead; R12 matched TP or MLA rooms
go direct (page to page) through the same endpoints; R13 a writer posts writes only under a lease that decode's
frames renew, and decode reuses a fenced writer's space only once `Timing.quarantine_s` bounds its last write.
docs/protocol.md has the state tables and diagrams.

Failure reasons: reasons.py (`FAILURE_REASONS`), e.g. "peer dead", "aborted by decode", "aborted by prefill",
"timeout", "transfer failed", "staging oversized", "send failed", "room closed"; grant refusals "unknown room".
"""

from kvstage.protocol import reasons
from kvstage.protocol.actions import (
    Action,
    FencePeer,
    FenceScatter,
    FreePages,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.codec import Codec
from kvstage.protocol.config import DecodeConfig, Limits, PrefillConfig, Timing
from kvstage.protocol.decode import DecodeEndpoint
from kvstage.protocol.events import (
    AbortRoom,
    AttachRoom,
    Completion,
    ComputeScheduled,
    Event,
    ExpectRoom,
    KVReady,
    Received,
    ReceivedFrame,
    SendFailed,
    Tick,
)
from kvstage.protocol.prefill import PrefillEndpoint
from kvstage.protocol.stats import EndpointStats

__all__ = [
    "AbortRoom",
    "Action",
    "AttachRoom",
    "Codec",
    "Completion",
    "ComputeScheduled",
    "DecodeConfig",
    "DecodeEndpoint",
    "EndpointStats",
    "Event",
    "ExpectRoom",
    "FencePeer",
    "FenceScatter",
    "FreePages",
    "KVReady",
    "Limits",
    "PrefillConfig",
    "PrefillEndpoint",
    "Received",
    "ReceivedFrame",
    "RoomFailed",
    "RoomSucceeded",
    "Scatter",
    "Send",
    "SendFailed",
    "Tick",
    "Timing",
    "WriteDirect",
    "WriteRegion",
    "reasons",
]
