"""What a request's `kv_transfer_params` may say to kvstage, checked without ever raising, and the room it gets.

Owns `RoomParams` (the router's room and the peer instance), `parse_params` (a client can send anything: a request
whose kvstage keys are malformed is refused with a reason and runs without kvstage, it never reaches an agent),
`handoff_params` (prefill's answer in vLLM's sequential flow), `prompt_digest` and `child_room`.

Two flows name a room. kvstage's router draws it and sends both sides at once (`kvstage_room`, `kvstage_peer`,
`kvstage_peer_tp`). vLLM's sequential flow sends prefill `{"do_remote_decode": true}` alone (`RemoteDecode`:
prefill draws the room, and decode's TP size comes with decode's Metadata), then hands decode what prefill answered
(`handoff_params`: `do_remote_prefill`, the room, and prefill's instance and TP size). Behind sglang-router
(sglang_router.py) prefill gets `{"do_remote_decode": true, "kvstage_room": R}`: the same, in the router's room R,
while decode gets the router's flow's keys.

vLLM turns one client request into several engine requests (`n > 1`, a list of prompts) that all carry the same
params; each gets a room of its own, derived from the router's room, the digest of its prompt and its place among
the requests that share both. Prefill and decode derive the same rooms, since each engine sees the same prompts in
the same order; Metadata carries the digest, so a room that still pairs two different prompts fails instead of
landing.

Pure (no vLLM, no I/O). Called by scheduler.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeGuard

import numpy as np

#: The keys the router puts into a request's `kv_transfer_params`.
ROOM_KEY: Final = "kvstage_room"
PEER_KEY: Final = "kvstage_peer"
PEER_TP_KEY: Final = "kvstage_peer_tp"
#: vLLM's keys of the sequential flow: to prefill, "compute this for a remote decode"; to decode, "the prompt's KV
#: comes from a remote prefill" (with the kvstage keys of prefill's answer).
REMOTE_DECODE_KEY: Final = "do_remote_decode"
REMOTE_PREFILL_KEY: Final = "do_remote_prefill"

MAX_ROOM: Final = 2**63 - 1
MAX_PEER_LEN: Final = 200  # an instance name; the peer ids built from it stay below the wire's bound
MAX_PEER_TP: Final = 1024
DIGEST_BYTES: Final = 16


@dataclass(frozen=True, slots=True)
class RoomParams:
    """A request's checked kvstage parameters: the router's room and the peer instance (name and TP size).

    On prefill in the sequential flow the peer is not known yet: `peer` is empty and `peer_tp` 0."""

    room: int
    peer: str
    peer_tp: int

    @property
    def sequential(self) -> bool:
        return self.peer_tp == 0


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """A prefill request of vLLM's sequential flow: compute the prompt and hold its KV for a decode not known yet,
    in room `room` (0: prefill draws one)."""

    room: int = 0


def parse_params(params: object, producer: bool) -> RoomParams | RemoteDecode | str | None:
    """What a request's `kv_transfer_params` ask of this instance (a prefill one when `producer`): `RoomParams`,
    `RemoteDecode`, None for a request that asks nothing of kvstage, or why they are unusable."""
    if not isinstance(params, Mapping):
        return None
    remote_decode, remote_prefill = params.get(REMOTE_DECODE_KEY, False), params.get(REMOTE_PREFILL_KEY, False)
    for key, flag in ((REMOTE_DECODE_KEY, remote_decode), (REMOTE_PREFILL_KEY, remote_prefill)):
        if not isinstance(flag, bool):
            return f"{key} must be true or false, got {_short(flag)}"
    if remote_decode:
        return _remote_decode(params, producer, remote_prefill)
    if ROOM_KEY not in params:
        return f"{REMOTE_PREFILL_KEY} without {ROOM_KEY}: not a kvstage prefill's answer" if remote_prefill else None
    if remote_prefill and producer:
        return f"{REMOTE_PREFILL_KEY}: a prefill's answer, sent to a prefill instance"
    return _room_params(params)


def _remote_decode(params: Mapping[object, object], producer: bool, remote_prefill: bool) -> RemoteDecode | str:
    if not producer:
        return f"{REMOTE_DECODE_KEY} sent to a decode instance (kv_consumer)"
    if remote_prefill:
        return f"{REMOTE_DECODE_KEY} and {REMOTE_PREFILL_KEY} both true"
    if ROOM_KEY not in params:
        return RemoteDecode()
    if PEER_KEY in params or PEER_TP_KEY in params:
        return f"{REMOTE_DECODE_KEY} with {PEER_KEY}: a request follows the router's flow or vLLM's, not both"
    room = params[ROOM_KEY]
    if not _is_int(room) or not 0 < room <= MAX_ROOM:
        return f"{ROOM_KEY} must be an integer in [1, 2**63), got {_short(room)}"
    return RemoteDecode(room)


def _room_params(params: Mapping[object, object]) -> RoomParams | str:
    room, peer, peer_tp = params.get(ROOM_KEY), params.get(PEER_KEY), params.get(PEER_TP_KEY)
    if not _is_int(room) or not 0 < room <= MAX_ROOM:
        return f"{ROOM_KEY} must be an integer in [1, 2**63), got {_short(room)}"
    if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_LEN or "/" in peer or not peer.isprintable():
        return (
            f"{PEER_KEY} must be an instance name (1-{MAX_PEER_LEN} printable characters, no '/'), got {_short(peer)}"
        )
    if not _is_int(peer_tp) or not 0 < peer_tp <= MAX_PEER_TP:
        return f"{PEER_TP_KEY} must be an integer in [1, {MAX_PEER_TP}], got {_short(peer_tp)}"
    return RoomParams(room, peer, peer_tp)


def handoff_params(room: int, instance: str, tp_size: int) -> dict[str, object]:
    """Prefill's answer in the sequential flow, for the client to hand to decode: the room, and this instance."""
    return {
        REMOTE_PREFILL_KEY: True,
        REMOTE_DECODE_KEY: False,
        ROOM_KEY: room,
        PEER_KEY: instance,
        PEER_TP_KEY: tp_size,
    }


def prompt_digest(tokens: Sequence[int]) -> bytes:
    """A digest of a prompt's token ids (what decode's Metadata carries and prefill compares)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())  # one C pass: this runs on vLLM's scheduler thread
    return h.digest()


def child_room(room: int, digest: bytes, index: int) -> int:
    """The room of the `index`-th engine request (in arrival order) that carries router room `room` and a prompt
    of digest `digest`; in [1, 2**63)."""
    h = hashlib.blake2b(digest_size=8, person=b"kvstage-room")
    h.update(room.to_bytes(8, "little") + digest + index.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") % MAX_ROOM + 1


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
