"""Events: everything that can happen to an endpoint, as frozen values passed to `endpoint.handle(event, now)`.

Owns the input vocabulary of the sans-I/O endpoints. The caller (runtime/ or sim/) turns engine calls, socket
frames, transfer/scatter completions and timer expiries into these values; the endpoint answers each with a
list of actions (actions.py). `now` is always supplied by the caller; endpoints never read a clock.

| event            | side    | who produces it                                                              |
|------------------|---------|------------------------------------------------------------------------------|
| ExpectRoom       | decode  | decode engine: admit a request, hand over its KV pages                       |
| AttachRoom       | prefill | prefill engine: it will compute this room and must hand it off               |
| ComputeScheduled | prefill | prefill engine: about to compute KV of tokens [0, end_tokens) (R11)          |
| KVReady          | prefill | prefill engine: KV of tokens [0, end_tokens) is computed, in these pages     |
| AbortRoom        | both    | the local engine gives up on a room                                          |
| Received         | both    | runtime/sim: a decoded envelope arrived                                      |
| ReceivedFrame    | both    | runtime/sim: raw bytes arrived; the endpoint decodes and counts bad frames   |
| Completion       | both    | runtime/sim: an action with a `token` finished (WriteRegion, WriteDirect,    |
|                  |         | Scatter, FenceScatter); echoes the token, ok or failed with a reason         |
| SendFailed       | both    | runtime/sim: a Send action could not be carried out (outbox full, socket)    |
| Tick             | both    | runtime/sim: time passed; call when now >= endpoint.next_timer()             |

Engine events are checked when handled: an engine call that is wrong in itself (a room id registered twice,
a page list that does not cover the tokens, an aux row on a KVReady that does not complete its room or over
`Limits.max_aux_bytes`, an unknown room) raises `InvalidRequest` before any state changes;
an engine call for a room that already ended (e.g. KVReady racing a RoomFailed) is ignored. Network and
completion events never raise: bad input is counted in `endpoint.stats` and dropped or answered.

Called by: runtime/ and sim/ (construct), decode.py and prefill.py (consume). Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstage.protocol.messages import Envelope


@dataclass(frozen=True, slots=True)
class ExpectRoom:
    """Decode engine: register `room` (R2: before its metadata is sent) with the decode KV `pages` that will
    hold tokens [0, num_tokens), `ceil(num_tokens / page_size)` of them; tokens [0, prefix_tokens) are already
    there (decode-side prefix cache) and are not transferred. `prefill_peers[r]` is the peer id of prefill rank
    r of the instance that computes the room (so len(prefill_peers) is that instance's TP size). `deadline`
    is absolute, in the caller's clock. `prompt` is a digest of the prompt's tokens (empty: unchecked); the
    prefill side fails the room if its engine's prompt has another digest. `direct=False` says the writers cannot
    write these pages page to page (their KV is laid out otherwise, e.g. in another page size): the room stages
    even at matched TP sizes (R12)."""

    room: int
    prefill_peers: tuple[str, ...]
    num_tokens: int
    prefix_tokens: int
    pages: tuple[int, ...]
    deadline: float
    prompt: bytes = b""
    direct: bool = True


@dataclass(frozen=True, slots=True)
class AttachRoom:
    """Prefill engine: this rank computes `room` of `num_tokens` tokens for a decode instance of TP `decode_tp`.

    The prefill endpoint then waits for Metadata from every decode rank it writes to (none, if this rank's heads
    are all served by replicas: the room then succeeds at once). `prompt` is the digest of the prompt the engine
    computes (empty: unchecked); a decode rank whose Metadata names another prompt fails the room.

    `decode_tp` 0: the decode instance is not known yet (vLLM's sequential flow, where decode hears of the request
    only after prefill has computed it); the first decode rank's Metadata fixes it, and every later one must agree.
    Until then the room waits, holding its pages, for Metadata or its deadline.

    `claim_s` > 0: once the engine has computed the whole prompt (KVReady up to `num_tokens`), the room waits that
    long at most for the first decode rank's Metadata; then it fails "unclaimed" and its pages come back (a decode
    request that never came, or that its engine refused). 0: it waits until its deadline."""

    room: int
    num_tokens: int
    decode_tp: int
    deadline: float
    prompt: bytes = b""
    claim_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ComputeScheduled:
    """Prefill engine: the next forward pass computes KV up to token `end_tokens` (exclusive) of `room`.

    Staging is requested for the chunks that start before `end_tokens`, in chunk order, and no earlier (R11)."""

    room: int
    end_tokens: int


@dataclass(frozen=True, slots=True)
class KVReady:
    """Prefill engine: KV of tokens [0, end_tokens) of `room` is computed and lives in `pages` (page i holds
    tokens [i*page_size, (i+1)*page_size)). `pages` covers at least ceil(end_tokens / page_size) pages; the
    endpoint only reads them, and the engine keeps them until RoomSucceeded/RoomFailed of the room.

    `aux`: an opaque row the engine hands to decode with the room (sglang: first output token, logprobs, room id),
    at most `Limits.max_aux_bytes`. Only the KVReady that completes the room (end_tokens == its num_tokens) may
    carry one; the first such KVReady fixes it. It rides the ChunkReady of the room's last chunk to every decode
    rank this rank writes to, and decode reports it in RoomSucceeded."""

    room: int
    end_tokens: int
    pages: tuple[int, ...]
    aux: bytes = b""


@dataclass(frozen=True, slots=True)
class AbortRoom:
    """Local engine: give up on `room` (decode: reason "aborted by decode"; prefill: "aborted by prefill"), or, on
    prefill, fail it for `reason` (the runtime's "invalid request" once it refused an engine call of the room)."""

    room: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Received:
    """A decoded envelope arrived from the network."""

    envelope: Envelope


@dataclass(frozen=True, slots=True)
class ReceivedFrame:
    """Raw frame bytes arrived; the endpoint decodes them with its Codec and counts rejected frames."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class Completion:
    """The action that carried `token` finished: ok, or failed with `reason` (free text, for logs). `peer_gone`:
    the transport knows why a write failed, the peer's process or session is gone (the room ends "peer dead")."""

    token: int
    ok: bool = True
    reason: str = ""
    peer_gone: bool = False


@dataclass(frozen=True, slots=True)
class SendFailed:
    """The Send of `envelope` to `peer` could not be carried out. A room-scoped message fails its room (R3)."""

    peer: str
    envelope: Envelope
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: run retries, heartbeats, peer-liveness checks and deadlines due at `now`."""


Event = (
    ExpectRoom
    | AttachRoom
    | ComputeScheduled
    | KVReady
    | AbortRoom
    | Received
    | ReceivedFrame
    | Completion
    | SendFailed
    | Tick
)
