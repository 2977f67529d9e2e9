"""How the router chooses one instance among those that may take a request, and what a prompt's prefix looks like.

Owns:
- `POLICIES`: `round_robin` (in turn), `load` (least load: the router's own requests in flight to the instance,
  plus vLLM's waiting queue where its `/metrics` was read recently), `prefix` (decode: the instance most likely to
  hold the prompt's prefix, under a load bound; prefill: least load);
- `Candidate`: an instance that may take the request now, with its load and the prompt blocks it likely holds;
- `PromptBlocks` / `prompt_blocks`: chain hashes of a prompt's block-aligned leading units. A prompt given as
  token ids is hashed `block_tokens` ids a block, like vLLM's prefix cache; text (and a chat's messages, as
  canonical JSON) `4 * block_tokens` UTF-8 bytes a block, an approximation of the same tokens that needs no
  tokenizer (same leading text, same leading tokens);
- `HashRing`: consistent hashing of instance names (64 points each), so that a prefix maps to the same decode
  from any router and the mapping moves little when instances join or leave;
- `PrefixIndex`: per instance, the block hashes the router has seen it serve, least recently used out first,
  at most `per_instance` each; the router's estimate of that instance's prefix cache (vLLM may have evicted);
- `LoadBound`, `least_loaded` and `by_prefix`: the choices. `by_prefix` is consistent hashing with bounded
  loads: only an instance whose load stays within `ceil(balance * (total load + 1) / n) + slack` with this
  request may take it, so one hot prefix cannot pile onto one decode (the slack, a few requests, keeps the bound
  from splitting prefixes at low load, where one request more is no overload); among those, the most blocks held
  wins, then ring order from the prompt's first block, then least load.

Invariants: pure and deterministic (no clock, no I/O); the index is bounded in entries per instance and forgets
an instance that leaves. Called by `router.health` (the pools) and `router.proxy`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvstage.router.instances import Instance

POLICIES: Final = ("round_robin", "load", "prefix")
#: Text is hashed this many UTF-8 bytes per token (about what BPE tokenizers average on English).
BYTES_PER_TOKEN: Final = 4
#: Only this many leading blocks of a prompt are hashed: a longer shared prefix is rare, and hashing is bounded.
MAX_BLOCKS: Final = 512
_POINTS: Final = 64


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """Chain hashes of a prompt's full leading blocks (`hashes[i]` names blocks 0..i), and the prompt's length."""

    hashes: tuple[bytes, ...]
    units: int  # token ids, or UTF-8 bytes of text
    block_units: int

    def uncached_units(self, held: int) -> int:
        """Units of the prompt beyond its first `held` blocks."""
        return self.units - held * self.block_units

    @property
    def key(self) -> bytes | None:
        """The prompt's place on the hash ring: its first block, or None when it is shorter than a block."""
        return self.hashes[0] if self.hashes else None


NO_BLOCKS: Final = PromptBlocks((), 0, 1)


def _chain(data: bytes, units: int, block_units: int, unit_bytes: int) -> PromptBlocks:
    step = block_units * unit_bytes
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(units // block_units, MAX_BLOCKS) * step, step):
        previous = _digest(previous + data[start : start + step])
        hashes.append(previous)
    return PromptBlocks(tuple(hashes), units, block_units)


def _first_prompt(body: dict[str, Any], chat: bool) -> object:
    if chat:
        return body.get("messages")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt[0]  # a list of prompts: the first one names the prefix
    return prompt


def prompt_blocks(body: dict[str, Any], *, chat: bool, block_tokens: int) -> PromptBlocks:
    """The chain hashes of the request's leading blocks; `NO_BLOCKS` for a prompt of no shape the router knows."""
    prompt = _first_prompt(body, chat)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**63 for t in prompt):
        ids = array("q", prompt).tobytes()
        return _chain(ids, len(prompt), block_tokens, 8)
    if isinstance(prompt, str):
        text = prompt.encode()
    elif chat and isinstance(prompt, list):
        text = json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()
    else:
        return NO_BLOCKS
    return _chain(text, len(text), block_tokens * BYTES_PER_TOKEN, 1)


class HashRing:
    """Consistent hashing of names: `order(key)` walks the ring from `key`, each name once."""

    def __init__(self, names: Iterable[str]) -> None:
        points = sorted((_digest(f"{name}#{i}".encode()), name) for name in set(names) for i in range(_POINTS))
        self._keys = [p for p, _ in points]
        self._names = [n for _, n in points]
        self.names = frozenset(self._names)

    def order(self, key: bytes) -> list[str]:
        start = bisect.bisect(self._keys, _digest(key))
        seen: dict[str, None] = {}
        for i in range(len(self._names)):
            seen.setdefault(self._names[(start + i) % len(self._names)])
            if len(seen) == len(self.names):
                break
        return list(seen)


class PrefixIndex:
    """Block hashes each instance was seen to serve, at most `per_instance` each (least recently used out)."""

    def __init__(self, per_instance: int = 65536) -> None:
        self._per_instance = per_instance
        self._held: dict[Instance, OrderedDict[bytes, None]] = {}

    def held(self, instance: Instance, blocks: PromptBlocks) -> int:
        """How many leading blocks of the prompt the instance likely holds (chain hashes: the longest one found)."""
        known = self._held.get(instance)
        if not known:
            return 0
        for count in range(len(blocks.hashes), 0, -1):
            if blocks.hashes[count - 1] in known:
                return count
        return 0

    def record(self, instance: Instance, blocks: PromptBlocks) -> None:
        """The instance now holds the prompt's blocks; the first block is kept longest (vLLM also evicts a
        request's last blocks first)."""
        known = self._held.setdefault(instance, OrderedDict())
        for digest in reversed(blocks.hashes):
            known[digest] = None
            known.move_to_end(digest)
        while len(known) > self._per_instance:
            known.popitem(last=False)

    def forget(self, instance: Instance) -> None:
        self._held.pop(instance, None)


@dataclass(frozen=True, slots=True)
class Candidate:
    """An instance that may take the request now; `held`: prompt blocks it likely holds (prefix policy)."""

    instance: Instance
    load: float
    held: int = 0


def first_in_turn(candidates: Sequence[Candidate]) -> Candidate:
    """Round robin: candidates come in turn from the one after the last pick."""
    return candidates[0]


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """The least loaded candidate; the first of equals (candidates come in round-robin order)."""
    return min(candidates, key=lambda c: c.load)


@dataclass(frozen=True, slots=True)
class LoadBound:
    """The most load an instance may have with one request more: `balance` times the mean, plus `slack`."""

    balance: float = 1.25
    slack: int = 4

    def cap(self, total: float, instances: int) -> float:
        return math.ceil(self.balance * (total + 1) / instances) + self.slack


def by_prefix(candidates: Sequence[Candidate], key: bytes | None, ring: HashRing, bound: LoadBound) -> Candidate:
    """Bounded-load consistent hashing, preferring the candidates that hold more of the prompt (module doc)."""
    cap = bound.cap(sum(c.load for c in candidates), len(candidates))
    within = [c for c in candidates if c.load + 1 <= cap]
    if not within:
        return least_loaded(candidates)
    rank = {name: i for i, name in enumerate(ring.order(key))} if key is not None else {}
    return min(within, key=lambda c: (-c.held, rank.get(c.instance.name, len(rank)), c.load))
