"""The aux row: an engine's opaque bytes that ride a room's last chunk from prefill to decode.

Owns the rules of the aux row (sglang's metadata row: first output token, logprobs, room id): the prefill engine
gives it with the KVReady that completes a room (`KVReady.aux`), the prefill endpoint puts it on the ChunkReady of
the room's last chunk towards every decode rank it writes to (`ChunkReady.aux`; retries carry the same bytes), and
decode reports it with the room's success (`RoomSucceeded.aux`). Its bound is `Limits.max_aux_bytes`, which must
leave the largest ChunkReady frame within the codec's `max_frame_bytes` (`check_aux_fits`, at configuration).

Invariants: a refused aux row on a KVReady is an invalid engine call (prefill.py raises `InvalidRequest` before any
state changes); a refused aux row on a ChunkReady fails its room "protocol violation" on decode (decode.py), with
a fixed rejection label (`stats.reject`), so no wire input grows the counters. Decode keeps one aux row per open
room, of at most `max_aux_bytes`.

Pure: no I/O, clock or randomness. Called by prefill.py and decode.py (the rules), base.py and runtime/config.py
(the frame check).
"""

from __future__ import annotations

import msgspec

from kvstage.errors import ConfigError
from kvstage.protocol.events import KVReady
from kvstage.protocol.messages import (
    MAX_BYTES,
    MAX_CHUNKS,
    MAX_CLOCK,
    MAX_ID,
    MAX_PEER_ID_LEN,
    PROTOCOL_VERSION,
    ChunkReady,
    Envelope,
    WireWatermark,
)

#: `stats.reject` labels of a refused ChunkReady aux row (fixed: no wire value becomes a counter key).
NOT_LAST_CHUNK = "aux row on a chunk that is not the room's last"
OVER_BOUND = "aux row over Limits.max_aux_bytes"
CONFLICT = "aux rows of the room's writers differ"


def kv_ready_aux_problem(event: KVReady, num_tokens: int, ready: int, given: bytes, limit: int) -> str | None:
    """Why the aux row of `event` is refused (None: accepted, or none given). The room has `num_tokens` tokens, is
    computed up to `ready` and was given `given` (the aux row of the KVReady that completed it, if one did)."""
    aux = event.aux
    if not aux:
        return None
    if len(aux) > limit:
        return f"room {event.room}: aux row of {len(aux)} bytes exceeds Limits.max_aux_bytes={limit}"
    if event.end_tokens != num_tokens:
        return (
            f"room {event.room}: KVReady(end_tokens={event.end_tokens}) carries an aux row, but only the KVReady "
            f"that completes the room ({num_tokens} tokens) may"
        )
    if ready == num_tokens and aux != given:
        return f"room {event.room}: its aux row was fixed by the KVReady that completed it; this one differs"
    return None


def chunk_ready_aux_problem(body: ChunkReady, num_chunks: int, kept: bytes, limit: int) -> str | None:
    """Why the aux row of `body`, a ChunkReady of a room of `num_chunks` chunks whose aux row so far is `kept`, is
    a protocol violation (a fixed label; None: accepted, or none carried)."""
    aux = body.aux
    if not aux:
        return None
    if body.chunk != num_chunks - 1:
        return NOT_LAST_CHUNK
    if len(aux) > limit:
        return OVER_BOUND
    if kept and aux != kept:
        return CONFLICT
    return None


def largest_ready_frame(max_aux_bytes: int) -> int:
    """Bytes of the largest ChunkReady frame carrying an aux row of `max_aux_bytes`: every field at its bound."""
    body = ChunkReady(room=MAX_ID, chunk=MAX_CHUNKS - 1, epoch=MAX_ID, aux=bytes(max_aux_bytes))
    sender = "p" * MAX_PEER_ID_LEN
    envelope = Envelope(PROTOCOL_VERSION, sender, MAX_ID, MAX_ID, MAX_ID, WireWatermark(MAX_ID, MAX_BYTES), body,
                        MAX_CLOCK, MAX_CLOCK)  # fmt: skip
    return len(msgspec.msgpack.encode(envelope))


def check_aux_fits(max_aux_bytes: int, max_frame_bytes: int) -> None:
    """`ConfigError` unless a ChunkReady with an aux row of `max_aux_bytes` fits a frame of `max_frame_bytes`."""
    need = largest_ready_frame(max_aux_bytes)
    if need > max_frame_bytes:
        raise ConfigError(
            f"Limits.max_aux_bytes={max_aux_bytes} does not fit a control frame: the last chunk's ChunkReady takes "
            f"up to {need} bytes, max_frame_bytes is {max_frame_bytes}; lower the one or raise the other"
        )
