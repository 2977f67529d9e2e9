"""Actions: what an endpoint asks its caller to do, as frozen values returned by `endpoint.handle(event, now)`.

Owns the output vocabulary of the sans-I/O endpoints. The caller carries the actions out in list order. An
action that has a `token` must later be answered by exactly one `Completion(token, ok, reason)` event (a
transfer or scatter that fails is answered with ok=False, never dropped).

| action        | side    | the caller must                                                                  |
|---------------|---------|----------------------------------------------------------------------------------|
| Send          | both    | send `envelope` to `peer` (never blocking the engine); report SendFailed if not  |
| WriteRegion   | prefill | gather this rank's block of the chunk from `src_pages` into local staging and    |
|               |         | bulk-write it to the decode peer's ring at `dst_offset` (one write); Completion  |
| WriteDirect   | prefill | copy the chunk's head slice `transfer` page to page, `src_pages` -> `dst_pages`  |
|               |         | on the decode peer (direct path, R12); Completion                                |
| Scatter       | decode  | scatter every writer block of `region` into the room's KV pages by `plan`, tokens |
|               |         | `[token_start, token_end)`; Completion                                           |
| FenceScatter  | decode  | wait until no scatter of `room` is in flight (per room, not a device sync);      |
|               |         | Completion. Only then are the room's ring space and KV pages released (R1)       |
| FreePages     | decode  | return the failed room's decode KV `pages` to the pool (never on success)        |
| FencePeer     | both    | `peer`'s incarnation (session, epoch) is dead here: drop its frames, release     |
|               |         | what the runtime holds for it. Its posted writes may still land: decode keeps   |
|               |         | their space quarantined until R13 (writer leases) says they cannot              |
| RoomSucceeded | both    | decode: the room's pages hold its KV (and `aux` the engine's aux row), generate. |
|               |         | prefill: the pages are no longer read, the engine may free them                  |
| RoomFailed    | both    | the room failed for `reason` (reasons.py). decode: pages come back by FreePages; |
|               |         | prefill: no write of the room reads its pages any more, the engine may free them |

Called by: decode.py and prefill.py (construct), runtime/ and sim/ (execute). Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstage.layout import HeadTransfer, StagingPlan, WriterBlock
from kvstage.protocol.messages import Envelope
from kvstage.ring import Allocation


@dataclass(frozen=True, slots=True)
class Send:
    """Send `envelope` to `peer`."""

    peer: str
    envelope: Envelope


@dataclass(frozen=True, slots=True)
class WriteRegion:
    """Staged path: gather `block` (this writer's heads, `num_tokens` tokens from position `src_offset` of
    `src_pages[0]`, which is the room's token `token_start`) and write it to `peer`'s ring bytes
    `[dst_offset, dst_offset + block.nbytes)`. `src_pages` are the writer's own pages: where its page size differs
    from decode's, a chunk (which starts on a decode page) may start inside one of them (`src_offset` > 0)."""

    token: int
    peer: str
    room: int
    chunk: int
    src_pages: tuple[int, ...]
    num_tokens: int
    token_start: int
    block: WriterBlock
    region: Allocation
    writer_session: int  # this writer's incarnation towards `peer` when it emitted the write: a write of an
    writer_epoch: int  # earlier epoch is never posted (`may_post`); R13 bounds when a posted one can land
    dst_session: int  # the decode session that granted the region: a restarted decode's new ring must not
    # receive it (real transports fail it: the old registration is gone)
    src_offset: int = 0  # the chunk's first token's position in src_pages[0] (0 where both page sizes match)

    @property
    def dst_offset(self) -> int:
        return self.region.offset + self.block.offset


@dataclass(frozen=True, slots=True)
class WriteDirect:
    """Direct path: copy heads `transfer` of `num_tokens` tokens from `src_pages` (local) to `dst_pages` on `peer`.

    `dst_pages` (decode's) start at the chunk's first token, which begins a decode page; `src_pages` (the writer's
    own) hold it at position `src_offset` of their first page (0 where both page sizes match)."""

    token: int
    peer: str
    room: int
    chunk: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    num_tokens: int
    transfer: HeadTransfer
    writer_session: int  # as in WriteRegion
    writer_epoch: int
    dst_session: int
    src_offset: int = 0


@dataclass(frozen=True, slots=True)
class Scatter:
    """Scatter every writer block of chunk `chunk` from ring `region`, following `plan`, into the room's decode KV
    pages (those of `ExpectRoom`) at the room's tokens `[token_start, token_start + num_tokens)`.

    The token range is the chunk of `layout.ChunkGrid`; `num_tokens == plan.num_tokens`."""

    token: int
    room: int
    chunk: int
    region: Allocation
    plan: StagingPlan
    token_start: int
    num_tokens: int

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_tokens


@dataclass(frozen=True, slots=True)
class FenceScatter:
    """Complete `token` once no scatter of `room` is in flight any more."""

    token: int
    room: int


@dataclass(frozen=True, slots=True)
class FreePages:
    """Return a failed room's decode KV pages to the pool; nothing writes them any more."""

    room: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FencePeer:
    """`peer`'s incarnation (session, epoch) and every older one is dead to this endpoint."""

    peer: str
    session: int
    epoch: int


@dataclass(frozen=True, slots=True)
class RoomSucceeded:
    """decode: `aux` is the room's aux row as its last chunk's writers sent it (empty: none was given);
    prefill: always empty."""

    room: int
    aux: bytes = b""


@dataclass(frozen=True, slots=True)
class RoomFailed:
    room: int
    reason: str


Action = Send | WriteRegion | WriteDirect | Scatter | FenceScatter | FreePages | FencePeer | RoomSucceeded | RoomFailed
