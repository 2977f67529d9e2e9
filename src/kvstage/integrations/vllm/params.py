"""What a request's `kv_transfer_params` may say to kvstage, checked without ever raising, and the room it gets.

Owns `RoomParams` (the router's room and the peer instance), `parse_params` (a client can send anything: a request
whose kvstage keys are malformed is refused with a reason and runs without kvstage, it never reaches an agent),
`prompt_digest` and `child_room`. vLLM turns one client request into several engine requests (`n > 1`, a list of
prompts) that all carry the same params; each gets a room of its own, derived from the router's room, the digest
of its prompt and its place among the requests that share both. Prefill and decode derive the same rooms, since
each engine sees the same prompts in the same order; Metadata carries the digest, so a room that still pairs two
different prompts fails instead of landing.

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

MAX_ROOM: Final = 2**63 - 1
MAX_PEER_LEN: Final = 200  # an instance name; the peer ids built from it stay below the wire's bound
MAX_PEER_TP: Final = 1024
DIGEST_BYTES: Final = 16


@dataclass(frozen=True, slots=True)
class RoomParams:
    """A request's checked kvstage parameters: the router's room and the peer instance (name and TP size)."""

    room: int
    peer: str
    peer_tp: int


def parse_params(params: object) -> RoomParams | str | None:
    """`RoomParams`, None for a request that does not name a kvstage room, or why its kvstage keys are unusable."""
    if not isinstance(params, Mapping) or ROOM_KEY not in params:
        return None
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
