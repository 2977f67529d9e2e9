"""Wire messages of the kvstage control plane: msgspec Structs in a tagged union, inside a versioned `Envelope`.

Owns: every message body two endpoints exchange, the `Envelope` that carries it, and the hard bounds on every
field (`Meta` constraints, checked by `kvstage.protocol.codec` when a frame is decoded). A frame that violates a
bound never reaches an endpoint; the endpoints then check each field against what they already know about the
room (chunk index < the room's chunk count, page count = the room's page count, ...).

Envelope: `version` (must equal `PROTOCOL_VERSION`), `sender` (the sending endpoint's stable peer id),
`session` + `epoch` (the sender's incarnation towards this receiver: `session` is new for every process start
and increases across restarts; `epoch` is bumped by the sender when the receiver has fenced it; the pair
compares as a tuple), `seq` (per-sender counter, for tracing), `watermark` (the sender's ring watermark: set on
every decode->prefill message, None on prefill->decode messages), `body`, and the two clock readings of the
writer lease (docs/protocol.md, "Writer leases"): `stamp` is the sender's clock when it sent the frame, `echo` the
highest `stamp` the sender has received from the addressee (None before the first). Only the receiver of an
echo reads it, against its own clock, so no two clocks are ever compared.

Bodies and who sends them (D = DecodeEndpoint, P = PrefillEndpoint). "request" bodies are retried with backoff
until their answer arrives; every handler is idempotent under duplicates and reordering.

| body            | from | kind     | answered by                 |
|-----------------|------|----------|-----------------------------|
| Heartbeat       | both | periodic | nothing (liveness; on D it carries the watermark) |
| Fenced          | both | reply    | nothing (the receiver bumps its epoch towards the sender) |
| Metadata        | D    | request  | MetadataAck, or Abort(reason="overloaded"/"bad metadata") |
| MetadataAck     | P    | answer   |                             |
| StagingRequest  | P    | request  | Grant or GrantRefused       |
| Grant           | D    | answer   |                             |
| GrantRefused    | D    | answer   |                             |
| ChunkReady      | P    | request  | ChunkAck                    |
| ChunkAck        | D    | answer   |                             |
| Abort           | both | request  | AbortAck                    |
| AbortAck        | both | answer   | (P sends it only once no write of the room can land) |

Called by: codec.py (decode/encode), decode.py and prefill.py (build and read bodies), runtime/ and sim/
(carry envelopes). Pure data, no behaviour.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

#: Bumped on any incompatible change to a body or the envelope; a frame of another version is rejected.
#: Version 2 added the lease clocks `Envelope.stamp` and `Envelope.echo`; version 3 `Metadata.prompt`; version 4
#: `ChunkReady.aux`.
PROTOCOL_VERSION: Final = 4

# ---- hard bounds, checked at decode time (before an endpoint sees the message) -------------------------------
MAX_ID: Final = 2**63 - 1
MAX_PEER_ID_LEN: Final = 256
MAX_REASON_LEN: Final = 128
MAX_TP: Final = 1024
MAX_TOKENS: Final = 2**26
MAX_CHUNKS: Final = 2**16
MAX_PAGES: Final = 2**21
MAX_PAGE_ID: Final = 2**40
MAX_BYTES: Final = 2**62
MAX_CLOCK: Final = 1e12  # seconds of a monotonic clock (about 31,000 years)
MAX_DIGEST_LEN: Final = 32
MAX_AUX_BYTES: Final = 2**20  # hard bound of `ChunkReady.aux`; `Limits.max_aux_bytes` (at most this) is the working one

RoomId = Annotated[int, Meta(ge=0, le=MAX_ID)]
Count = Annotated[int, Meta(ge=0, le=MAX_ID)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_TP)]
TpSize = Annotated[int, Meta(ge=1, le=MAX_TP)]
Tokens = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
ChunkIndex = Annotated[int, Meta(ge=0, lt=MAX_CHUNKS)]
ByteOffset = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
PageId = Annotated[int, Meta(ge=0, le=MAX_PAGE_ID)]
Pages = Annotated[tuple[PageId, ...], Meta(max_length=MAX_PAGES)]
Reason = Annotated[str, Meta(max_length=MAX_REASON_LEN)]
PeerId = Annotated[str, Meta(min_length=1, max_length=MAX_PEER_ID_LEN)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e7)]
ClockReading = Annotated[float, Meta(ge=0.0, le=MAX_CLOCK)]  # NaN and infinities are refused too
Digest = Annotated[bytes, Meta(max_length=MAX_DIGEST_LEN)]
AuxRow = Annotated[bytes, Meta(max_length=MAX_AUX_BYTES)]
Path = Literal["staged", "direct"]

STAGED: Final = "staged"
DIRECT: Final = "direct"


class _Body(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=True):
    """Base of every message body; the class name is the tag on the wire."""


class Heartbeat(_Body, frozen=True, tag="hb"):
    """Liveness, both ways, every `Timing.heartbeat_s`; on decode->prefill it also re-sends the watermark."""


class Fenced(_Body, frozen=True, tag="fenced"):
    """'Your incarnation (session, epoch) is fenced here': the receiver fails its rooms with the sender, bumps
    its epoch towards the sender and is then served as a new incarnation."""

    session: Count
    epoch: Count


class Metadata(_Body, frozen=True, tag="meta"):
    """D -> each writer P of the room, sent only after the room is registered on D (R2).

    `pages` are D's KV pages for tokens [0, num_tokens) and are sent only on the direct path (empty when
    staged); `ring_bytes` is D's ring capacity on the staged path, so P can refuse a grant outside the ring.
    `epoch` fences direct-path writes (staged rooms use per-chunk allocation epochs). `ttl_s` is how long the
    room may still live, relative to the receiver's clock when it arrives. `prompt` is a digest of the room's
    prompt tokens as the decode engine knows them (empty: not checked); P fails a room whose engine computes
    another prompt, so a misrouted room never lands.

    `bystander`: decode rank 0's notice to a prefill rank that writes to no decode rank in this room (replicated
    heads, or an MLA latent, from a larger prefill TP): it tells that rank decode's TP size, so a room it attached
    without one (vLLM's sequential flow, sglang) ends at once instead of waiting for Metadata that never comes.
    Answered with `MetadataAck`; it links nothing.
    """

    room: RoomId
    decode_rank: Rank
    decode_tp: TpSize
    prefill_tp: TpSize
    num_tokens: Tokens
    prefix_tokens: Tokens
    chunk_tokens: Tokens
    page_size: Tokens
    path: Path
    epoch: Count
    ttl_s: Seconds
    pages: Pages = ()
    ring_bytes: ByteOffset = 0  # staged: capacity of D's ring, so a grant beyond it is refused (0: unknown)
    prompt: Digest = b""
    bystander: bool = False  # a notice to a rank that writes nothing in this room (see above)


class MetadataAck(_Body, frozen=True, tag="meta_ack"):
    """P -> D: the metadata of `room` is stored (the room may not be attached by P's engine yet)."""

    room: RoomId


class StagingRequest(_Body, frozen=True, tag="stage_req"):
    """P -> D: grant me the region of `chunk` (staged) or permission to write its pages (direct)."""

    room: RoomId
    chunk: ChunkIndex


class Grant(_Body, frozen=True, tag="grant"):
    """D -> P: chunk `chunk` of `room` lives at ring `[offset, end)` in `round`; echo `epoch` in ChunkReady.

    On the direct path round/offset/end are 0 and `epoch` is the room's epoch from its Metadata.
    """

    room: RoomId
    chunk: ChunkIndex
    round: Count
    offset: ByteOffset
    end: ByteOffset
    epoch: Count


class GrantRefused(_Body, frozen=True, tag="grant_no"):
    """D -> P: no grant. reason "unknown room": retry until the deadline (R2); "room closed": fail now."""

    room: RoomId
    chunk: ChunkIndex
    reason: Reason


class ChunkReady(_Body, frozen=True, tag="ready"):
    """P -> D: my block of `chunk` has landed (the write completed); `epoch` echoes the grant's.

    `aux`: the engine's opaque aux row of the room (e.g. sglang's first output token and logprobs), given with the
    KVReady that completed the room; only on the room's last chunk (empty otherwise, and where the engine gave none).
    Decode reports it with the room's success."""

    room: RoomId
    chunk: ChunkIndex
    epoch: Count
    aux: AuxRow = b""


class ChunkAck(_Body, frozen=True, tag="ready_ack"):
    """D -> P: ChunkReady of `chunk` received (also for duplicates)."""

    room: RoomId
    chunk: ChunkIndex


class Abort(_Body, frozen=True, tag="abort"):
    """Either way: `room` failed on the sender for `reason`. From P it also means: no write of mine can land."""

    room: RoomId
    reason: Reason


class AbortAck(_Body, frozen=True, tag="abort_ack"):
    """Either way: Abort of `room` received. P sends it only once no write of the room can still land (R6)."""

    room: RoomId


Body = (
    Heartbeat
    | Fenced
    | Metadata
    | MetadataAck
    | StagingRequest
    | Grant
    | GrantRefused
    | ChunkReady
    | ChunkAck
    | Abort
    | AbortAck
)

#: Bodies that name a room (every body except Heartbeat and Fenced).
RoomBody = Metadata | MetadataAck | StagingRequest | Grant | GrantRefused | ChunkReady | ChunkAck | Abort | AbortAck


class WireWatermark(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The decode ring's watermark (round, tail) as sent on the wire."""

    round: Count
    tail: ByteOffset


class Envelope(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One frame: who sent it (peer id and incarnation), in which order, the watermark, the body, and the lease
    clocks (`stamp`: the sender's clock at sending; `echo`: the highest stamp it received from the addressee).

    The lease clocks come last and have defaults (an echo of None grants no lease), so a frame of protocol
    version 1, which lacks them, still decodes far enough to be refused by its version with a clear message."""

    version: Annotated[int, Meta(ge=0, le=2**16)]
    sender: PeerId
    session: Count
    epoch: Count
    seq: Count
    watermark: WireWatermark | None
    body: Body
    stamp: ClockReading = 0.0
    echo: ClockReading | None = None

    @property
    def incarnation(self) -> tuple[int, int]:
        """(session, epoch): compares as a tuple; higher is newer."""
        return (self.session, self.epoch)
