"""Hostile and broken frames that the simulated network slips into endpoints' inboxes (B1).

Owns `hostile_frame`, which draws one frame a buggy, stale or malicious peer could send: random bytes, a
truncated frame, a frame of another protocol version, a msgpack header claiming billions of elements, a frame
with an out-of-range field, messages for rooms nobody registered, and messages for real rooms from a stale
incarnation (session 0, older than every real session) or from a sender nobody knows. None of them may grow
an endpoint's state or change a room: the checker verifies that every endpoint only ever holds real rooms.

Also what a confused peer does with real frames it saw on the wire (`forged_from`, `stale_chunk_ready`): replay
one as it was, replay it from an older incarnation of its sender, retarget a writer's notice or request to a
room that writer has no part in, or announce a chunk in the writer's name with an epoch other than its grant's.
Each of these a correct endpoint drops, refuses or treats as the duplicate it is.

Called by sim/world.py; draws from the world's random generator only.
"""

from __future__ import annotations

import random

import msgspec

from kvstage.protocol import Codec
from kvstage.protocol.messages import (
    MAX_CHUNKS,
    PROTOCOL_VERSION,
    Abort,
    Body,
    ChunkReady,
    Envelope,
    Grant,
    GrantRefused,
    Metadata,
    MetadataAck,
    StagingRequest,
)

#: Room ids at or above this are never used by the simulator's rooms.
FORGED_ROOM_BASE = 1 << 40
#: Real frames the hostile peer remembers to replay or alter.
RECENT_FRAMES = 64


def _envelope(sender: str, session: int, body: Body, version: int = PROTOCOL_VERSION) -> Envelope:
    return Envelope(version=version, sender=sender, session=session, epoch=0, seq=0, watermark=None, body=body)


def _forged_body(rng: random.Random, room: int) -> Body:
    chunk = rng.choice((0, 1, MAX_CHUNKS - 1))
    choice = rng.randrange(5)
    if choice == 0:
        return ChunkReady(room=room, chunk=chunk, epoch=rng.getrandbits(20))
    if choice == 1:
        return StagingRequest(room=room, chunk=chunk)
    if choice == 2:
        end = rng.getrandbits(30)
        return Grant(room=room, chunk=chunk, round=rng.getrandbits(8), offset=end // 2, end=end, epoch=1)
    if choice == 3:
        return GrantRefused(room=room, chunk=chunk, reason="room closed")
    return Abort(room=room, reason="aborted by prefill")


def _forged_metadata(rng: random.Random, room: int) -> Metadata:
    """Metadata of a room nobody registered, with a lifetime anywhere up to the wire bound."""
    tp = rng.choice((1, 2, 4))
    return Metadata(
        room=room,
        decode_rank=rng.randrange(tp),
        decode_tp=tp,
        prefill_tp=rng.choice((1, 2, 4)),
        num_tokens=rng.randint(1, 64),
        prefix_tokens=0,
        chunk_tokens=8,
        page_size=4,
        path=rng.choice(("staged", "direct")),
        epoch=1,
        ttl_s=rng.choice((0.5, 30.0, 1e7)),
    )


def hostile_frame(rng: random.Random, codec: Codec, peers: list[str], rooms: list[int]) -> bytes:
    """One frame that every endpoint must reject or ignore without allocating anything lasting."""
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 48))
    if kind == 1:
        return b"\xdd\xff\xff\xff\xff"  # msgpack array32 header claiming 4 billion elements, then nothing
    forged_room = FORGED_ROOM_BASE + rng.getrandbits(20)
    if kind == 2:
        frame = codec.encode(_envelope(rng.choice(peers), 1, _forged_body(rng, forged_room)))
        return frame[: rng.randrange(1, len(frame))]
    if kind == 3:
        return codec.encode(_envelope(rng.choice(peers), 1, _forged_body(rng, forged_room), version=99))
    if kind == 4:
        # a field out of its wire bounds: a negative chunk index, encoded without the codec's checks
        raw = [PROTOCOL_VERSION, rng.choice(peers), 1, 0, 0, None, ["ready", rng.choice(rooms), -5, 0]]
        return msgspec.msgpack.encode(raw)
    if kind == 5:
        # a real room, from a peer that is neither its writer nor its decode rank
        return codec.encode(
            _envelope(f"{rng.choice('PD')}9.{rng.randrange(4)}", 1, _forged_body(rng, rng.choice(rooms)))
        )
    if kind == 6:
        # a room nobody registered announced by a sender nobody knows, possibly "valid" for 115 days
        return codec.encode(_envelope("x-hostile", 1 + rng.getrandbits(30), _forged_metadata(rng, forged_room)))
    # a room nobody registered, from a sender nobody knows
    return codec.encode(_envelope("x-hostile", 1 + rng.getrandbits(30), _forged_body(rng, forged_room)))


def forged_from(rng: random.Random, envelope: Envelope, kind: int, foreign_rooms: list[int]) -> Envelope | None:
    """A real envelope replayed as is (kind 1), from an older incarnation of its sender (kind 2), or, when it is
    a writer's notice, request or ack, about a room of `foreign_rooms`, where the sender is no writer (kind 3)."""
    if kind == 1:
        return envelope
    if kind == 2:
        if envelope.epoch:
            return msgspec.structs.replace(envelope, epoch=envelope.epoch - 1)
        return msgspec.structs.replace(envelope, session=envelope.session - 1) if envelope.session else None
    body = envelope.body
    if not foreign_rooms or not isinstance(body, ChunkReady | StagingRequest | MetadataAck):
        return None
    return msgspec.structs.replace(envelope, body=msgspec.structs.replace(body, room=rng.choice(foreign_rooms)))


def stale_chunk_ready(writer: str, session: int, epoch: int, grant: Grant) -> Envelope:
    """The writer's "chunk written" notice for a chunk it was just granted, with an epoch that is not the grant's
    (an older grant's, say): decode must drop it (R7), whatever the writer has written so far."""
    body = ChunkReady(room=grant.room, chunk=grant.chunk, epoch=grant.epoch + 1)
    return Envelope(
        version=PROTOCOL_VERSION, sender=writer, session=session, epoch=epoch, seq=0, watermark=None, body=body
    )
