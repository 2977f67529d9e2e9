"""Failure reasons of a room and refusal reasons of a grant: the closed vocabulary of `RoomFailed.reason`.

Owns: the strings the endpoints put in `RoomFailed`, `Abort` and `GrantRefused`, and that runtime/ exports as
the `reason` label of its failure metrics. Every room failure uses exactly one of `FAILURE_REASONS`; tests and
the simulator count by them. Pure constants; imported by decode.py, prefill.py, runtime/ and sim/.
"""

from __future__ import annotations

from typing import Final

# ---- why a room failed (RoomFailed.reason, Abort.reason, EndpointStats.failures keys) ------------------------
PEER_DEAD: Final = "peer dead"  # the peer went silent past Timing.dead_after_s
PEER_RESTARTED: Final = "peer restarted"  # the peer came back with a newer session; its old rooms are gone
FENCED_BY_PEER: Final = "fenced by peer"  # the peer had declared us dead; we start a new epoch towards it
ABORTED_BY_DECODE: Final = "aborted by decode"  # the decode engine aborted, or decode failed the room
ABORTED_BY_PREFILL: Final = "aborted by prefill"  # the prefill engine aborted, or prefill failed the room
TIMEOUT: Final = "timeout"  # the room's deadline passed before it completed
TRANSFER_FAILED: Final = "transfer failed"  # a bulk or direct write reported failure
SCATTER_FAILED: Final = "scatter failed"  # the decode-side scatter reported failure
STAGING_OVERSIZED: Final = "staging oversized"  # one chunk needs more bytes than the whole ring (no fallback)
SEND_FAILED: Final = "send failed"  # the runtime could not send a control message of the room
LEASE_EXPIRED: Final = "lease expired"  # a write could not be posted: decode was not heard from within lease_s
ROOM_CLOSED: Final = "room closed"  # decode no longer serves the room (it ended there)
BAD_METADATA: Final = "bad metadata"  # metadata disagrees with the room or with this endpoint's layout
PROTOCOL_VIOLATION: Final = "protocol violation"  # the peer answered with something impossible for the room
OVERLOADED: Final = "overloaded"  # the peer refused the room: its per-peer room cap is reached
UNCLAIMED: Final = "unclaimed"  # prefill computed the room's KV and no decode rank took it within AttachRoom.claim_s
INVALID_REQUEST: Final = "invalid request"  # runtime/ refused the engine's call (bad pages, ...); endpoints never
# use it: they raise InvalidRequest, and the runtime turns that into this failure

FAILURE_REASONS: Final = frozenset(
    {
        PEER_DEAD,
        PEER_RESTARTED,
        FENCED_BY_PEER,
        ABORTED_BY_DECODE,
        ABORTED_BY_PREFILL,
        TIMEOUT,
        TRANSFER_FAILED,
        SCATTER_FAILED,
        STAGING_OVERSIZED,
        SEND_FAILED,
        LEASE_EXPIRED,
        ROOM_CLOSED,
        BAD_METADATA,
        PROTOCOL_VIOLATION,
        OVERLOADED,
        UNCLAIMED,
        INVALID_REQUEST,
    }
)

# ---- why a staging request got no grant (GrantRefused.reason) ------------------------------------------------
UNKNOWN_ROOM: Final = "unknown room"  # never heard of it: the writer retries until its deadline (R2)
# ROOM_CLOSED (above): the room ended on decode; the writer fails the room at once.
# PROTOCOL_VIOLATION (above): wrong chunk/path/writer; the writer fails the room at once.
