"""The state tables of both endpoints, and the one function that moves a room or a chunk from state to state.

Owns the room states of each side (`DecodeRoomState`, `PrefillRoomState`), the prefill side's per-link chunk
states (`ChunkState`), the triggers that move them, and three tables of edges (`DECODE_ROOM`, `PREFILL_ROOM`,
`PREFILL_CHUNK`). Everything that affects those states lives here, as in h11's `_state.py`:

- `table.can(holder, trigger)`: whether `trigger` is an edge out of the holder's current state. The endpoints ask
  this wherever the input (a late message, a duplicate, a completion after a failure) may legitimately not
  apply; then they ignore, refuse or count it.
- `table.move(holder, trigger, what)`: take that edge. It is the only code that sets a `state`, and it raises
  `ProtocolError` for an edge that is not in the table (a bug of the endpoint, never of the input).

Every state a room or chunk ever has is in its table, from NONE (just created) to FORGOTTEN (removed from the
endpoint; a room is then remembered only in the bounded closed-room record). docs/protocol.md shows the tables
as `table.markdown()` renders them, and tests/protocol/test_states.py holds the two equal. Each edge carries the
prose of its row ("on" and "actions"); a self-loop row names what the endpoint does while it stays.

Pure: no I/O, clock or randomness. Called by decode.py and prefill.py; runtime/ reads `PrefillRoomState`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvstage.errors import ProtocolError

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)


class _Enum(enum.Enum):
    """An Enum hashed by identity, in C: the tables look (state, trigger) up on most events, and Enum's own
    `__hash__` is a Python call. Members are singletons compared by identity, so the two hashes agree on
    equality."""

    __hash__ = object.__hash__


class DecodeRoomState(_Enum):
    NONE = "(none)"  # created; about to be registered
    ACTIVE = "active"
    FENCING = "fencing"  # failed; waiting for the FenceScatter completion
    QUARANTINED = "quarantined"  # failed and fenced; waiting until no write can land, then for every ack
    FORGOTTEN = "(forgotten)"


class PrefillRoomState(_Enum):
    NONE = "(none)"  # created by AttachRoom
    ACTIVE = "active"
    DRAINING = "draining"  # failed; waiting for in-flight writes to complete
    CLOSING = "closing"  # failed and drained; waiting for decode ranks to acknowledge the abort
    FORGOTTEN = "(forgotten)"


class ChunkState(_Enum):
    """One chunk of one link (a room towards one decode rank) on a prefill rank."""

    NONE = "(none)"
    REQUESTED = "requested"
    GRANTED = "granted"  # parked while its region is not ready
    WRITING = "writing"
    NOTIFYING = "notifying"
    FORGOTTEN = "(forgotten)"  # acknowledged, and dropped from the link


class DecodeTrigger(_Enum):
    EXPECT = enum.auto()
    GRANT = enum.auto()
    CHUNK_READY = enum.auto()
    SCATTERED = enum.auto()
    SUCCEED = enum.auto()
    FAIL = enum.auto()
    FAIL_SCATTERING = enum.auto()
    FENCED = enum.auto()
    ABORT_ACK = enum.auto()
    RELEASE = enum.auto()
    FORGET = enum.auto()


class PrefillTrigger(_Enum):
    ATTACH_NOTHING = enum.auto()
    ATTACH = enum.auto()
    METADATA = enum.auto()
    COMPUTE = enum.auto()
    WRITE = enum.auto()
    WRITTEN = enum.auto()
    SUCCEED = enum.auto()
    FAIL = enum.auto()
    DRAINED = enum.auto()
    ACKNOWLEDGE = enum.auto()
    FORGET = enum.auto()


class ChunkTrigger(_Enum):
    REQUEST = enum.auto()
    GRANT = enum.auto()
    REFUSED = enum.auto()
    WRITE = enum.auto()
    WRITTEN = enum.auto()
    ACK = enum.auto()


class HasState(Protocol[S]):
    """A room or a chunk: anything with a `state` that a table moves."""

    state: S


@dataclass(frozen=True, slots=True)
class Edge(Generic[S, T]):
    """One row of a table: in `state`, `trigger` (described by `on`) does `actions` and leads to `next`."""

    state: S
    trigger: T
    next: S
    on: str
    actions: str


class Table(Generic[S, T]):
    """A state table: (state, trigger) -> next state. See the module docstring."""

    def __init__(self, name: str, edges: Sequence[Edge[S, T]]) -> None:
        self.name = name
        self.edges = tuple(edges)
        self._next: dict[tuple[S, T], S] = {}
        for edge in self.edges:
            key = (edge.state, edge.trigger)
            if key in self._next:
                raise AssertionError(f"{name}: two edges from {edge.state.name} on {edge.trigger.name}")
            self._next[key] = edge.next

    def can(self, holder: HasState[S], trigger: T) -> bool:
        """Whether the table has an edge from the holder's state on `trigger`."""
        return (holder.state, trigger) in self._next

    def move(self, holder: HasState[S], trigger: T, what: object) -> None:
        """Take the edge from the holder's state on `trigger`; `ProtocolError` if the table has none.

        `what` names the holder in the error (a room id, or a (room, chunk) pair)."""
        new = self._next.get((holder.state, trigger))
        if new is None:
            raise ProtocolError(f"{self.name} {what}: no edge from {holder.state.name} on {trigger.name}")
        holder.state = new

    def markdown(self) -> str:
        """The table as docs/protocol.md shows it, one row per edge, in table order."""
        rows = [("state", "on", "actions", "next"), ("---", "---", "---", "---")]
        rows += [(_label(e.state), e.on, e.actions, _label(e.next)) for e in self.edges]
        return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _label(state: enum.Enum) -> str:
    value = str(state.value)
    return value if value.startswith("(") else state.name


_D = DecodeRoomState
_DT = DecodeTrigger
_FAILURES = "`AbortRoom`, a writer's `Abort`, deadline, peer lost, scatter or send failure, oversized chunk"

DECODE_ROOM: Table[DecodeRoomState, DecodeTrigger] = Table(
    "decode room",
    [
        Edge(_D.NONE, _DT.EXPECT, _D.ACTIVE, "`ExpectRoom`", "register, then `Metadata` to each writer (retried)"),
        Edge(
            _D.ACTIVE, _DT.GRANT, _D.ACTIVE, "`StagingRequest(chunk)` from a writer", "allocate once per chunk; `Grant`"
        ),
        Edge(
            _D.ACTIVE,
            _DT.CHUNK_READY,
            _D.ACTIVE,
            "`ChunkReady(chunk, epoch)` from a writer",
            "`ChunkAck`; once every writer's arrived: staged `Scatter`, direct: chunk done",
        ),
        Edge(_D.ACTIVE, _DT.SCATTERED, _D.ACTIVE, "`Completion(scatter)`", "ok: `ring.free`, chunk done; else fail"),
        Edge(
            _D.ACTIVE, _DT.SUCCEED, _D.FORGOTTEN, "every chunk done", "`RoomSucceeded`; forget (remembered as closed)"
        ),
        Edge(
            _D.ACTIVE,
            _DT.FAIL,
            _D.QUARANTINED,
            f"{_FAILURES}; no scatter in flight",
            "`RoomFailed(reason)`; `Abort` to the other writers (retried); staged: `FreePages`",
        ),
        Edge(
            _D.ACTIVE,
            _DT.FAIL_SCATTERING,
            _D.FENCING,
            "the same, with a scatter of the room in flight",
            "`RoomFailed(reason)`; `Abort` to the other writers (retried); `FenceScatter`",
        ),
        Edge(_D.FENCING, _DT.FENCED, _D.QUARANTINED, "`Completion(fence)`", "staged: `FreePages`"),
        Edge(_D.FENCING, _DT.ABORT_ACK, _D.FENCING, "`AbortAck` from a writer", "the writer confirmed"),
        Edge(_D.QUARANTINED, _DT.ABORT_ACK, _D.QUARANTINED, "`AbortAck` from a writer", "the writer confirmed"),
        Edge(
            _D.QUARANTINED,
            _DT.RELEASE,
            _D.QUARANTINED,
            "every writer that was ever granted confirmed: `AbortAck` or its own `Abort` from the incarnation that "
            "served the room; declared dead (at once); restarted (once `quarantine_s` has passed since decode last "
            "heard its old incarnation)",
            "`ring.free` of the room's regions; direct: `FreePages`",
        ),
        Edge(_D.QUARANTINED, _DT.FORGET, _D.FORGOTTEN, "every writer confirmed", "forget (remembered as closed)"),
    ],
)

_P = PrefillRoomState
_PT = PrefillTrigger

PREFILL_ROOM: Table[PrefillRoomState, PrefillTrigger] = Table(
    "prefill room",
    [
        Edge(
            _P.NONE,
            _PT.ATTACH_NOTHING,
            _P.FORGOTTEN,
            "`AttachRoom`, this rank writes to no decode rank",
            "`RoomSucceeded` (its heads are served by replicas)",
        ),
        Edge(_P.NONE, _PT.ATTACH, _P.ACTIVE, "`AttachRoom`", "adopt metadata that arrived first"),
        Edge(
            _P.ACTIVE, _PT.METADATA, _P.ACTIVE, "`Metadata` from a target decode rank", "`MetadataAck`; request staging"
        ),
        Edge(
            _P.ACTIVE,
            _PT.COMPUTE,
            _P.ACTIVE,
            "`ComputeScheduled(end)` / `KVReady(end)`",
            "`StagingRequest` for chunks starting `< end`, in order, at most `max_chunks_ahead` unwritten; write",
        ),
        Edge(
            _P.ACTIVE,
            _PT.WRITE,
            _P.ACTIVE,
            "`Grant` / `GrantRefused` / `ChunkAck` / watermark moved",
            "region ready and KV computed: `WriteRegion` or `WriteDirect`, else park; `ChunkAck` drops its chunk",
        ),
        Edge(_P.ACTIVE, _PT.WRITTEN, _P.ACTIVE, "`Completion(write)`", "ok: `ChunkReady` (retried until `ChunkAck`)"),
        Edge(
            _P.ACTIVE,
            _PT.SUCCEED,
            _P.FORGOTTEN,
            "last `ChunkAck` of every link, or (no link) decode rank 0's writes-nothing `Metadata`",
            "`RoomSucceeded`; forget",
        ),
        Edge(
            _P.ACTIVE,
            _PT.FAIL,
            _P.DRAINING,
            "`AbortRoom`, decode's `Abort`, deadline, peer lost, write or send failure, bad grant or metadata",
            "stop requests, unpark",
        ),
        Edge(
            _P.DRAINING,
            _PT.DRAINED,
            _P.CLOSING,
            "no write of the room in flight",
            "`RoomFailed`; `AbortAck` to decode ranks that aborted; `Abort` (retried) to the others",
        ),
        Edge(
            _P.CLOSING,
            _PT.ACKNOWLEDGE,
            _P.CLOSING,
            "`AbortAck` / `Abort` / death of a decode rank it waits for",
            "that rank knows",
        ),
        Edge(_P.CLOSING, _PT.FORGET, _P.FORGOTTEN, "no decode rank left to wait for", "forget (remembered as closed)"),
    ],
)

_C = ChunkState
_CT = ChunkTrigger

PREFILL_CHUNK: Table[ChunkState, ChunkTrigger] = Table(
    "prefill chunk",
    [
        Edge(_C.NONE, _CT.REQUEST, _C.REQUESTED, "its tokens are about to be computed (R11)", "`StagingRequest`"),
        Edge(_C.REQUESTED, _CT.GRANT, _C.GRANTED, "`Grant`", "write it, or park it until its region is ready"),
        Edge(
            _C.REQUESTED, _CT.REFUSED, _C.REQUESTED, "`GrantRefused`", "unknown room: keep asking; else fail the room"
        ),
        Edge(_C.GRANTED, _CT.WRITE, _C.WRITING, "KV computed and region ready", "`WriteRegion` or `WriteDirect`"),
        Edge(_C.WRITING, _CT.WRITTEN, _C.NOTIFYING, "`Completion(write, ok)`", "`ChunkReady` (retried)"),
        Edge(_C.NOTIFYING, _CT.ACK, _C.FORGOTTEN, "`ChunkAck`", "drop it from the link"),
    ],
)
