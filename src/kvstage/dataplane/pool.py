"""A rank's paged KV pool: its storage, its byte geometry and its page allocator.

Owns:
- `PageGeometry`: a rank's pages and local heads, wherever its KV lives (token, page and head range checks);
  `PoolGeometry` adds a `KVPool`'s byte layout, `[K|V, layer, slot, head, head_dim]`, and the byte offset of any
  (kv, layer, slot, head) in it. Pure arithmetic, so a remote peer can compute addresses without the tensor.
- `PageAllocator`: hands out page ids, counts pages in use, refuses double and foreign frees, reports leaks.
- `KVPool`: one flat `uint8` tensor holding every layer's K and V (transports register `flat` as a memory
  region), typed and integer views of it, and the validated mapping from a request's pages to slot indices
  (`look_up_slots`, shared with `EngineKV`, which has no allocator).
- `Plane`: a slot-addressed integer view of (part of) a rank's KV, what gather and scatter copy through.

Invariants: storage is a single contiguous allocation, `[2, num_layers, num_slots, num_heads, head_dim]`
row-major, with slot = page * page_size + position in page; a page id is either free or held by exactly one
owner; `slot_indices` only ever returns slots of pages that are currently allocated, distinct, and inside the pool,
and `RequestSlots.range` (a request's slots looked up once, sliced per chunk) checks again that its pages are
still allocated.

Called by dataplane.stage (gather/scatter), dataplane.direct (per-slice path), the reference engine and the
runtime agents (which also allocate and free pages per request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvstage.errors import InvalidRequest, KVPoolExhausted
from kvstage.layout import KVLayout, heads_of_rank, page_slice

#: torch dtype of each KVLayout dtype name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

#: Integer dtype of each word width, for bit-preserving copies.
WORD_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Pages = Sequence[int] | torch.Tensor


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `KVLayout.dtype` name."""
    return TORCH_DTYPES[name]


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """The pages of one rank's KV, wherever it lives: `num_pages` pages of `layout.page_size` tokens over
    `num_heads` local heads. Checks token, page and head ranges; knows nothing of bytes."""

    layout: KVLayout
    num_heads: int
    num_pages: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidRequest(f"{name} must be a positive integer, got {value!r}")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.layout.page_size

    def check_heads(self, head_start: int, num_heads: int) -> None:
        """`InvalidRequest` unless local heads `[head_start, head_start + num_heads)` exist in this pool."""
        if num_heads <= 0 or head_start < 0 or head_start + num_heads > self.num_heads:
            raise InvalidRequest(
                f"head range [{head_start}, {head_start + num_heads}) is outside this pool's "
                f"{self.num_heads} local heads"
            )

    def used_pages(self, pages: Pages, token_start: int, token_end: int) -> torch.Tensor:
        """The pages (CPU int64) holding tokens `[token_start, token_end)` of a request whose pages are `pages`.

        Checks the token range, that the request has enough pages, and that every used page is inside the pool
        and appears once.
        """
        page_list = torch.as_tensor(pages, dtype=torch.int64, device="cpu")
        if page_list.dim() != 1:
            raise InvalidRequest(f"pages must be one-dimensional, got shape {tuple(page_list.shape)}")
        if not 0 <= token_start < token_end:
            raise InvalidRequest(f"token range [{token_start}, {token_end}) is empty or negative")
        page_size = self.layout.page_size
        span = page_slice(token_start, token_end, page_size)
        first, last = span.start, span.stop
        if last > page_list.numel():
            raise InvalidRequest(
                f"tokens up to {token_end} need {last} pages of {page_size} tokens, the request has {page_list.numel()}"
            )
        used = page_list[first:last]
        outside = used[(used < 0) | (used >= self.num_pages)]
        if outside.numel():
            raise InvalidRequest(f"pages {outside.tolist()} are outside this pool's 0..{self.num_pages - 1}")
        if torch.unique(used).numel() != used.numel():
            raise InvalidRequest(f"pages {used.tolist()} repeat a page; a request's pages must be distinct")
        return used


@dataclass(frozen=True, slots=True)
class PoolGeometry(PageGeometry):
    """Byte layout of a `KVPool`: `[2 (K, V), num_layers, num_slots, num_heads, head_dim]`, row-major."""

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (token) of one layer, K or V, over this rank's heads."""
        return self.num_heads * self.layout.head_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V) over all slots."""
        return self.num_slots * self.slot_bytes

    @property
    def nbytes(self) -> int:
        return 2 * self.layout.num_layers * self.layer_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.layout.num_layers, self.num_slots, self.num_heads, self.layout.head_dim)

    def byte_offset(self, kv: int, layer: int, slot: int, head: int = 0) -> int:
        """Byte offset of K (kv=0) or V (kv=1) of `layer`, `slot`, local `head` in the flat storage."""
        for name, value, bound in (
            ("kv", kv, 2),
            ("layer", layer, self.layout.num_layers),
            ("slot", slot, self.num_slots),
            ("head", head, self.num_heads),
        ):
            if not 0 <= value < bound:
                raise InvalidRequest(f"{name}={value} is outside 0..{bound - 1}")
        return (
            (kv * self.layout.num_layers + layer) * self.layer_bytes
            + slot * self.slot_bytes
            + head * (self.layout.head_bytes)
        )


class PageAllocator:
    """Free-list allocator of page ids `0..num_pages-1`; each held page has one owner.

    Freed pages go to the back of the free list and allocation takes from the front, so allocation order is a
    deterministic function of the allocate/free history. `frees` counts the calls that returned pages: a page found
    held while it had one value is still held while it keeps it.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise InvalidRequest(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owners: dict[int, Hashable] = {}
        self._held = torch.zeros(num_pages, dtype=torch.bool)
        self.frees = 0

    @property
    def in_use(self) -> int:
        """Number of pages currently held."""
        return len(self._owners)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int, owner: Hashable = None) -> list[int]:
        """Take `count` pages for `owner`; `KVPoolExhausted` (and nothing taken) if fewer are free."""
        if count < 0:
            raise InvalidRequest(f"page count must be non-negative, got {count}")
        if count > len(self._free):
            raise KVPoolExhausted(count, len(self._free), self.num_pages)
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._owners[page] = owner
        self._held[pages] = True
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return `pages`; `InvalidRequest` (and nothing freed) for a page that is foreign, free, or repeated."""
        page_list = [int(page) for page in pages]
        foreign = [page for page in page_list if not 0 <= page < self.num_pages]
        if foreign:
            raise InvalidRequest(f"pages {foreign} do not belong to this pool of {self.num_pages} pages")
        not_held = [page for page in page_list if page not in self._owners]
        if not_held or len(set(page_list)) != len(page_list):
            raise InvalidRequest(f"double free: pages {not_held or page_list} are not all held exactly once")
        for page in page_list:
            del self._owners[page]
        self._held[page_list] = False
        self._free.extend(page_list)
        self.frees += bool(page_list)

    def owner_of(self, page: int) -> Hashable:
        """The owner of a held page; `InvalidRequest` if the page is free."""
        if page not in self._owners:
            raise InvalidRequest(f"page {page} is not allocated")
        return self._owners[page]

    def leaked(self) -> dict[Hashable, tuple[int, ...]]:
        """Pages still held, by owner; empty when every page has been returned."""
        by_owner: dict[Hashable, list[int]] = {}
        for page, owner in self._owners.items():
            by_owner.setdefault(owner, []).append(page)
        return {owner: tuple(sorted(pages)) for owner, pages in by_owner.items()}

    def check_held(self, pages: torch.Tensor) -> None:
        """`InvalidRequest` unless every page of the CPU int64 tensor `pages` is allocated (vectorised)."""
        free = pages[~self._held[pages]]
        if free.numel():
            raise InvalidRequest(f"pages {free.tolist()} are not allocated; KV must not touch freed pages")


class PagedKV(ABC):
    """What every KV store of a rank shares: its pages and heads (`geometry`) and its slot lookup."""

    geometry: PageGeometry

    @property
    def layout(self) -> KVLayout:
        return self.geometry.layout

    @property
    def num_heads(self) -> int:
        return self.geometry.num_heads

    @property
    def num_pages(self) -> int:
        return self.geometry.num_pages

    @abstractmethod
    def request_slots(self, pages: Pages, token_start: int, token_end: int) -> RequestSlots:
        """The slots of tokens `[token_start, token_end)` of `pages`, checked once, for slicing per chunk."""

    def slot_indices(self, pages: Pages, token_start: int, token_end: int) -> torch.Tensor:
        """Slots (int64, on the store's device) of tokens `[token_start, token_end)` of a request's `pages`.

        Vectorised: no loop per token. A caller that copies one request chunk by chunk should look its slots up
        once with `request_slots`.
        """
        return self.request_slots(pages, token_start, token_end).slots


class KVPool(PagedKV):
    """One rank's paged KV cache: every layer's K and V in one flat byte tensor, plus its page allocator."""

    geometry: PoolGeometry

    def __init__(self, layout: KVLayout, num_heads: int, num_pages: int, device: str | torch.device = "cpu") -> None:
        self.geometry = PoolGeometry(layout, num_heads, num_pages)
        self.allocator = PageAllocator(num_pages)
        self._flat = torch.zeros(self.geometry.nbytes, dtype=torch.uint8, device=torch.device(device))
        self.device = self._flat.device  # normalised: "cuda" becomes "cuda:0", so device checks compare equal

    @classmethod
    def for_rank(
        cls, layout: KVLayout, tp_size: int, rank: int, num_pages: int, device: str | torch.device = "cpu"
    ) -> KVPool:
        """The pool of TP `rank`, holding `len(heads_of_rank(...))` local heads."""
        return cls(layout, len(heads_of_rank(layout.num_kv_heads, tp_size, rank)), num_pages, device)

    @property
    def flat(self) -> torch.Tensor:
        """The whole storage as one contiguous 1-D `uint8` tensor (the memory region transports register)."""
        return self._flat

    @property
    def kv(self) -> torch.Tensor:
        """Typed view `[2, num_layers, num_slots, num_heads, head_dim]`; index 0 is K, 1 is V."""
        return self._flat.view(torch_dtype(self.layout.dtype)).view(self.geometry.shape)

    def k(self, layer: int) -> torch.Tensor:
        """K of `layer`: `[num_slots, num_heads, head_dim]`."""
        return self.kv[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        """V of `layer`: `[num_slots, num_heads, head_dim]`."""
        return self.kv[1, layer]

    def words(self, word_bytes: int) -> torch.Tensor:
        """Integer view `[2, num_layers, num_slots, num_heads, head_bytes // word_bytes]` for bit-exact copies."""
        shape = (*self.geometry.shape[:4], self.layout.head_bytes // word_bytes)
        return self._flat.view(WORD_DTYPES[word_bytes]).view(shape)

    #: Widest integer word (bytes) the storage's address allows; torch aligns every allocation to 64 bytes.
    max_word_bytes = 8

    def planes(self, word_bytes: int) -> tuple[Plane, ...]:
        """The whole pool as one slot-indexed plane: one copy op moves a block over every layer, K and V."""
        return (Plane(self.words(word_bytes), paged=False, axis=2, part=()),)

    def request_slots(self, pages: Pages, token_start: int, token_end: int) -> RequestSlots:
        """`slot_indices` of tokens `[token_start, token_end)`, kept with the pages they came from, so that each
        chunk of the request takes a view (`RequestSlots.range`) instead of a lookup of its own. Every used page
        must be inside the pool, distinct and currently allocated."""
        return look_up_slots(self.geometry, self.allocator, self.device, pages, token_start, token_end)


@dataclass(frozen=True, slots=True)
class Plane:
    """A slot-addressed integer view of (part of) a rank's KV, and the part of a writer block it maps to.

    `words` ends in `[heads, head_bytes // word]`. A flat plane (`paged=False`) has one slot axis, `axis`, with
    slot = page * page_size + position: one `index_select` / `index_copy_` moves its part. A paged plane is
    `[pages, page_size, heads, words]`, for a layout whose pages and positions cannot be merged into one axis
    (vLLM's CPU and HND layouts): it is indexed by (page, position). `part` indexes the writer block
    `[2 (K, V), num_layers, tokens, heads, words]`; `()` is the whole block.
    """

    words: torch.Tensor
    paged: bool
    axis: int
    part: tuple[int, ...]


def look_up_slots(
    geometry: PageGeometry,
    allocator: PageAllocator | None,
    device: torch.device,
    pages: Pages,
    token_start: int,
    token_end: int,
) -> RequestSlots:
    """The slots of tokens `[token_start, token_end)` of a request's `pages`, checked once.

    Every used page must be inside the pool and distinct, and, where kvstage allocates pages (`allocator`), held.
    The slots are computed on the CPU (8 bytes per token); for a GPU pool they cross in one copy from page-locked
    memory that the caller does not wait for: it is ordered on the current stream before the kernels that use the
    slots. (A plain copy waits for the device; measured on an H200 host with three ranks per GPU, that wait was
    0.6-1.6 ms per call, longer than the 16 MiB gather it fed.)
    """
    used = geometry.used_pages(pages, token_start, token_end)
    if allocator is not None:
        allocator.check_held(used)
    page_size = geometry.layout.page_size
    first = token_start % page_size  # used[0] is the page holding token_start
    slots = (used.view(-1, 1) * page_size + torch.arange(page_size)).view(-1)
    slots = slots[first : first + token_end - token_start]
    slots = slots.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else slots.to(device)
    frees = -1 if allocator is None else allocator.frees
    return RequestSlots(allocator, page_size, token_start, token_end, used, slots, frees)


@dataclass(frozen=True, slots=True, eq=False)
class RequestSlots:
    """The slots of tokens `[start, end)` of one request, looked up (and its pages validated) once.

    A lookup costs a dozen small CPU ops and, for a GPU pool, a copy to the device: about 0.1 ms alone and
    0.2-1.3 ms on an H200 host with six busy rank processes, more than the copy of a 16 MiB block it feeds. A
    chunk's `range` is a view of `slots`, plus, where kvstage allocates the pages (`allocator`), a check that they
    are still allocated (the engine may not free them before the request's outcome, and a copy never touches a
    freed page): none while the allocator has freed nothing since the lookup checked every page (`frees`), else one
    vectorised check (a few small tensor ops, 60-100 µs on a busy host). An engine's own KV (`EngineKV`) has no
    allocator: the engine vouches for its pages.
    """

    allocator: PageAllocator | None
    page_size: int
    start: int
    end: int
    pages: torch.Tensor  # CPU int64: the pages holding tokens [start, end), in token order
    slots: torch.Tensor  # int64 on the pool's device, one per token of [start, end)
    frees: int  # the allocator's `frees` when the lookup found every page held (-1 without an allocator)

    def range(self, token_start: int, token_end: int) -> torch.Tensor:
        """Slots of tokens `[token_start, token_end)`, which must lie inside `[start, end)`."""
        if not self.start <= token_start < token_end <= self.end:
            raise InvalidRequest(
                f"tokens [{token_start}, {token_end}) are outside the looked-up range [{self.start}, {self.end})"
            )
        if self.allocator is not None and self.allocator.frees != self.frees:
            base, span = self.start // self.page_size, page_slice(token_start, token_end, self.page_size)
            self.allocator.check_held(self.pages[span.start - base : span.stop - base])
        return self.slots[token_start - self.start : token_end - self.start]
