"""Simulated memory: KV page pools on both sides and decode staging buffers, with ownership tags.

Owns:
- `PagePool`: a KV-page allocator whose every page carries the tag of the room holding it, so a write or a
  scatter into a page after its room released it is caught (S2), and leaks are visible at quiescence (Q1).
- `KVMemory`: the bytes of one rank's KV pool (token-slot major: slot x K/V x layer x head x head_dim), present
  only when tensor payloads are on; gathers and scatters are vectorised numpy fancy indexing.
- `TrackedRing`: the real staging ring, reporting each allocation and free to the rank's `StagingMemory`.
- `StagingMemory`: the bytes of one decode rank's staging ring plus the owner of every granted region, so a
  write landing in another live (room, chunk) region (S1) or a scatter reading freed bytes (S2) is caught.
- `expected_kv`: the KV a prefill rank "computes" for a room, a pure function of (room key, token, head, layer,
  K/V, dim), so D1 can compare decode KV bit for bit against it.

KV elements are 16-bit words (a bf16 stand-in; copies are bit-preserving, so the dtype does not matter).
Called by sim/engines.py (pools, KV memory), sim/dataplane.py (gathers, writes, scatters) and
sim/invariants.py (ownership queries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstage.ring import Allocation, StagingRing

Words = npt.NDArray[np.uint16]
#: Owner of a region allocated but not (yet) granted to anyone.
UNLABELLED = "?"


@dataclass(frozen=True, slots=True)
class Owner:
    """Tag of a staging region: which (room, chunk) it was granted to, under which grant epoch."""

    room: str
    chunk: int
    epoch: int
    offset: int
    end: int


class PagePool:
    """Page allocator with per-page owner tags; refuses (returns None) when it has too few free pages."""

    def __init__(self, name: str, num_pages: int) -> None:
        self.name = name
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, str] = {}

    def allocate(self, count: int, owner: str) -> tuple[int, ...] | None:
        if count > len(self._free):
            return None
        pages = tuple(self._free.pop() for _ in range(count))
        for page in pages:
            self._owner[page] = owner
        return pages

    def free(self, pages: tuple[int, ...], owner: str) -> list[int]:
        """Return `owner`'s pages; gives back the pages that `owner` did not hold (a double or foreign free)."""
        foreign = [page for page in pages if self._owner.get(page) != owner]
        for page in pages:
            if self._owner.get(page) == owner:
                del self._owner[page]
                self._free.append(page)
        return foreign

    def foreign_pages(self, pages: tuple[int, ...], owner: str) -> list[int]:
        """Pages of `pages` that `owner` does not hold right now."""
        return [page for page in pages if self._owner.get(page) != owner]

    def owners(self) -> dict[int, str]:
        return dict(self._owner)

    @property
    def in_use(self) -> int:
        return len(self._owner)

    @property
    def free_count(self) -> int:
        return len(self._free)


def expected_kv(room_key: int, start: int, end: int, heads: range, num_layers: int, head_dim: int) -> Words:
    """KV of tokens [start, end) for global `heads`, shaped (2, layers, tokens, heads, head_dim)."""
    kv = np.arange(2, dtype=np.uint64).reshape(2, 1, 1, 1, 1)
    layer = np.arange(num_layers, dtype=np.uint64).reshape(1, num_layers, 1, 1, 1)
    token = np.arange(start, end, dtype=np.uint64).reshape(1, 1, end - start, 1, 1)
    head = np.array(list(heads), dtype=np.uint64).reshape(1, 1, 1, len(heads), 1)
    dim = np.arange(head_dim, dtype=np.uint64).reshape(1, 1, 1, 1, head_dim)
    mixed = np.uint64(room_key) * np.uint64(0x9E3779B1) + token * np.uint64(7919) + head * np.uint64(104729)
    mixed = mixed + layer * np.uint64(131) + kv * np.uint64(17) + dim
    mixed = (mixed * np.uint64(2654435761)) >> np.uint64(13)
    words: Words = (mixed & np.uint64(0xFFFF)).astype(np.uint16)
    return words


def expected_aux(room_key: int) -> bytes:
    """The aux row the prefill engine gives with the KVReady that completes a room, which every decode rank must
    report with the room's success (D1)."""
    return b"aux row of room " + room_key.to_bytes(8, "little")


class KVMemory:
    """One rank's KV pool bytes, indexed by token slot = page * page_size + offset in page."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_heads: int, head_dim: int) -> None:
        self.page_size = page_size
        self.data: Words = np.zeros((num_pages * page_size, 2, num_layers, num_heads, head_dim), dtype=np.uint16)

    def slots(self, pages: tuple[int, ...], start: int, end: int) -> npt.NDArray[np.int64]:
        """Token slots of tokens [start, end) of a room whose token t lives in page pages[t // page_size]."""
        tokens = np.arange(start, end, dtype=np.int64)
        page_index = np.asarray(pages, dtype=np.int64)[tokens // self.page_size]
        return page_index * self.page_size + tokens % self.page_size

    def read(self, pages: tuple[int, ...], start: int, end: int, head_start: int, num_heads: int) -> Words:
        """Tokens [start, end), local heads [head_start, +num_heads), as (2, layers, tokens, heads, head_dim)."""
        block = self.data[self.slots(pages, start, end), :, :, head_start : head_start + num_heads, :]
        return np.ascontiguousarray(block.transpose(1, 2, 0, 3, 4))

    def write(self, pages: tuple[int, ...], start: int, head_start: int, values: Words) -> None:
        """Inverse of `read`: `values` is (2, layers, tokens, heads, head_dim)."""
        tokens = values.shape[2]
        slots = self.slots(pages, start, start + tokens)
        self.data[slots, :, :, head_start : head_start + values.shape[3], :] = values.transpose(2, 0, 1, 3, 4)


class TrackedRing(StagingRing):
    """The real `StagingRing`, reporting every allocation and free to the rank's `StagingMemory`.

    The decode endpoint is given this ring, so the simulator learns region ownership from the ring itself, exactly
    when it changes, whatever the endpoint does."""

    def __init__(self, capacity_bytes: int, memory: StagingMemory) -> None:
        super().__init__(capacity_bytes)
        self.memory = memory

    def allocate(self, nbytes: int) -> Allocation:
        allocation = super().allocate(nbytes)
        self.memory.claim(Owner(UNLABELLED, -1, allocation.epoch, allocation.offset, allocation.end))
        return allocation

    def free(self, allocation: Allocation) -> bool:
        freed = super().free(allocation)
        if freed:
            self.memory.release(allocation.epoch)
        return freed


class StagingMemory:
    """One decode rank's staging bytes and the owner of every live granted region."""

    def __init__(self, capacity_bytes: int, payloads: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.data = np.zeros(capacity_bytes, dtype=np.uint8) if payloads else None
        self._owners: dict[int, Owner] = {}

    def claim(self, owner: Owner) -> None:
        self._owners[owner.epoch] = owner

    def release(self, epoch: int) -> Owner | None:
        return self._owners.pop(epoch, None)

    def label(self, epoch: int, room: str, chunk: int) -> None:
        """Name the (room, chunk) a live region was granted to (learnt from the Grant the endpoint sends)."""
        owner = self._owners.get(epoch)
        if owner is not None and owner.room == UNLABELLED:
            self._owners[epoch] = Owner(room, chunk, epoch, owner.offset, owner.end)

    def owner(self, epoch: int) -> Owner | None:
        return self._owners.get(epoch)

    def owners(self) -> list[Owner]:
        return list(self._owners.values())

    def overlapping(self, offset: int, end: int, room: str, chunk: int) -> list[Owner]:
        """Live regions of another (room, chunk) that intersect [offset, end)."""
        return [
            o for o in self._owners.values() if o.offset < end and offset < o.end and (o.room, o.chunk) != (room, chunk)
        ]

    def write(self, offset: int, payload: bytes) -> None:
        if self.data is not None:
            self.data[offset : offset + len(payload)] = np.frombuffer(payload, dtype=np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        assert self.data is not None
        return self.data[offset : offset + nbytes].tobytes()
