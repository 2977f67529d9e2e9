"""KV in the engine's own memory and layout: `EngineKV` wraps an engine's per-layer KV tensors without copying.

Owns `KVCacheFormat` (the layouts kvstage reads and writes in place) and `EngineKV`: per layer, K and V as 4-D
views `[num_pages, page_size, num_heads, head_dim]` of the engine's tensors, the page and head checks, the slot
lookup, and what gather and scatter (dataplane/stage.py) copy through: integer-word planes, or for `vllm_cpu` in
host memory its (block, head) tiles (`tiles`, dataplane/tiles.py). `KVStore` is what those copies and the runtime
agents accept: a kvstage `KVPool` or an `EngineKV`.

Formats (`layers[i]` is what the engine holds for layer i; B pages, N = page_size tokens, H local heads, D head_dim;
`c = t.view(B, H, 2, N*D)`):

| format     | layers[i]                             | K / V of (page b, position n, head h)                   |
|------------|---------------------------------------|---------------------------------------------------------|
| `kvstage`  | `[2, B*N, H, D]` (`KVPool.kv[:, i]`)   | `t[0, b*N + n, h]` / `t[1, b*N + n, h]`                 |
| `vllm_cpu` | `[B, H, N, 2*D]`, each (b, h) one run | `c[b, h, 0].view(D, N)[:, n]` / `c[b, h, 1].view(N, D)[n]` |
| `vllm_nhd` | `[B, H, N, 2*D]`, memory `B, N, H, 2D` | `t[b, h, n, :D]` / `t[b, h, n, D:]`                     |
| `vllm_hnd` | `[B, H, N, 2*D]`, memory `B, H, N, 2D` | `t[b, h, n, :D]` / `t[b, h, n, D:]`                     |
| `vllm_mla` | `[B, 1, N, 2*D]`, one latent row a token | `t[b, 0, n, :D]` / `t[b, 0, n, D:]`                     |
| `sglang`   | `(k, v)`, each `[B*N, H, D]`          | `k[b*N + n, h]` / `v[b*N + n, h]`                       |

The vLLM rows are what vLLM 0.32 hands a connector in `register_kv_caches` (`create_kv_cache_views`: a 4-D
`[blocks, heads, block_size, 2*head_size]` view per layer whose strides follow the resolved `KVCacheLayout`,
LBNHC for NHD and LBHNC for HND and CPU). Flash-attention splits the last axis into K and V. vLLM's CPU attention
splits each (block, head) run in two halves: K, stored transposed (`[head_dim, block_size]`, so its kernels read a
head dimension across the block's tokens), then V (`[block_size, head_dim]`). That is what its
`cpu_attn_reshape_and_cache` writes with its `vec` and `vec16` kernels (x86 without AMX, and fp32 and fp16 everywhere;
tests/dataplane/test_engine_kv_vllm.py checks it against vLLM's own op). Its `amx` kernels (bf16 on AMX hosts,
block size a multiple of 32) pack K and V in tiles: not a format kvstage reads. So
`vllm_cpu` and `vllm_hnd` have the same strides and differ inside a block: the format is the caller's statement,
and the strides are checked against it.

`vllm_mla` is an MLA model's latent cache (`MLAAttentionSpec`: one row of `kv_lora_rank + rope_dim` elements per
token, the same on every TP rank; in fp8 caches one byte an element). kvstage moves it as one head whose K is the
row's first half and V its second (`layout.latent_layout`), so its arithmetic is `vllm_nhd`'s with one head; the
format names what the bytes are, and refuses more than one head.

Invariants: `k`/`v` are views (their storage is the engine's); the page size is the engine's block size, read
off the tensors and checked against `layout.page_size`; the engine vouches for its pages (kvstage checks bounds
and distinctness, it allocates nothing); fp8 caches held as 1-byte integers are viewed in the layout's dtype.
Called by dataplane.stage, the runtime agents and engine integrations (kvstage.integrations).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import torch

from kvstage.dataplane.pool import (
    WORD_DTYPES,
    KVPool,
    PagedKV,
    PageGeometry,
    Pages,
    Plane,
    RequestSlots,
    look_up_slots,
    torch_dtype,
)
from kvstage.dataplane.tiles import Tiles
from kvstage.errors import ConfigError, InvalidRequest
from kvstage.layout import KVLayout


class KVCacheFormat(StrEnum):
    """How an engine lays its KV out; see the module docstring for each one's shapes."""

    KVSTAGE = "kvstage"
    VLLM_CPU = "vllm_cpu"
    VLLM_NHD = "vllm_nhd"
    VLLM_HND = "vllm_hnd"
    VLLM_MLA = "vllm_mla"
    SGLANG = "sglang"


Layers = Sequence[torch.Tensor] | Sequence[tuple[torch.Tensor, torch.Tensor]]


class EngineKV(PagedKV):
    """An engine's own KV tensors, seen per layer as K and V views `[num_pages, page_size, num_heads, head_dim]`."""

    def __init__(
        self, layout: KVLayout, fmt: KVCacheFormat, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
    ) -> None:
        """`keys[i]` / `values[i]`: views `[num_pages, page_size, num_heads, head_dim]` of layer i, any strides, all
        on one device. Use `from_layers` to build them from an engine's tensors."""
        views = [*keys, *values]
        if len(keys) != layout.num_layers or len(values) != layout.num_layers:
            raise ConfigError(f"{len(keys)} K and {len(values)} V tensors for a layout of {layout.num_layers} layers")
        shape = views[0].shape
        if len(shape) != 4 or shape[1] != layout.page_size or shape[3] != layout.head_dim:
            raise ConfigError(
                f"{fmt} KV views are {tuple(shape)}, expected [pages, page_size={layout.page_size}, heads, "
                f"head_dim={layout.head_dim}]; the page size is the engine's block size"
            )
        for view in views:
            _check_view(view, shape, views[0].device, layout)
        self.format = KVCacheFormat(fmt)
        dtype = torch_dtype(layout.dtype)
        self._keys = tuple(_canonical(view.view(dtype)) for view in keys)
        self._values = tuple(_canonical(view.view(dtype)) for view in values)
        self.geometry = PageGeometry(layout, shape[2], shape[0])
        self.device = views[0].device
        self.max_word_bytes = _max_word(views, layout.head_bytes)
        self._planes: dict[int, tuple[Plane, ...]] = {}
        tiled = self.format is KVCacheFormat.VLLM_CPU and self.device.type == "cpu"
        #: vLLM CPU's KV in host memory is copied run by run (dataplane/tiles.py); None: through `planes`.
        self.tiles = Tiles.of(self._keys, self._values) if tiled else None

    @classmethod
    def from_layers(cls, layout: KVLayout, fmt: KVCacheFormat, layers: Layers, num_heads: int) -> EngineKV:
        """Wrap `layers` (one entry per layer, in `fmt`'s form) without copying. `num_heads` is this rank's local
        KV heads; the number of pages is read off the tensors. `ConfigError` names what does not match."""
        fmt = KVCacheFormat(fmt)
        if len(layers) != layout.num_layers:
            raise ConfigError(f"{len(layers)} layer tensors given for a layout of {layout.num_layers} layers")
        pairs = [_split(fmt, layer, layout, num_heads) for layer in layers]
        return cls(layout, fmt, [k for k, _ in pairs], [v for _, v in pairs])

    def k(self, layer: int) -> torch.Tensor:
        """K of `layer`: a view `[num_pages, page_size, num_heads, head_dim]` of the engine's tensor."""
        return self._keys[layer]

    def v(self, layer: int) -> torch.Tensor:
        """V of `layer`: a view `[num_pages, page_size, num_heads, head_dim]` of the engine's tensor."""
        return self._values[layer]

    def planes(self, word_bytes: int) -> tuple[Plane, ...]:
        """One plane per (K/V, layer) in integer words of `word_bytes` (at most `max_word_bytes`): flat where
        pages and positions merge into one slot axis, paged where they cannot."""
        planes = self._planes.get(word_bytes)
        if planes is None:
            planes = self._planes[word_bytes] = tuple(
                _plane(view, word_bytes, (kv, layer))
                for kv, views in enumerate((self._keys, self._values))
                for layer, view in enumerate(views)
            )
        return planes

    def request_slots(self, pages: Pages, token_start: int, token_end: int) -> RequestSlots:
        """Slots (page * page_size + position) of tokens `[token_start, token_end)` of `pages`, kept for slicing per
        chunk (`RequestSlots.range`). The pages must be inside the engine's KV and distinct; nothing is allocated."""
        return look_up_slots(self.geometry, None, self.device, pages, token_start, token_end)


#: What gather and scatter copy from and into.
KVStore = KVPool | EngineKV


def _split(
    fmt: KVCacheFormat, layer: torch.Tensor | tuple[torch.Tensor, torch.Tensor], layout: KVLayout, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views `[pages, page_size, heads, head_dim]` of one layer in format `fmt`."""
    n, d = layout.page_size, layout.head_dim
    if fmt is KVCacheFormat.SGLANG:
        if not isinstance(layer, tuple | list) or len(layer) != 2:
            raise ConfigError("sglang KV is one (k, v) pair of [slots, heads, head_dim] tensors per layer")
        k, v = (_paged(t, fmt, layout, num_heads) for t in layer)
        return k, v
    if not isinstance(layer, torch.Tensor):
        raise ConfigError(f"{fmt} KV is one tensor per layer, got {type(layer).__name__}")
    if fmt is KVCacheFormat.KVSTAGE:
        _expect_shape(layer, (2, None, num_heads, d), fmt, "[2, slots, heads, head_dim]")
        return _paged(layer[0], fmt, layout, num_heads), _paged(layer[1], fmt, layout, num_heads)
    _expect_shape(layer, (None, num_heads, n, 2 * d), fmt, "[blocks, heads, block_size, 2*head_dim]")
    blocks = layer.shape[0]
    if fmt is KVCacheFormat.VLLM_CPU:
        if layer.stride(3) != 1 or (n > 1 and layer.stride(2) != 2 * d):
            raise ConfigError(f"vllm_cpu KV needs each (block, head) stored as one run, got strides {layer.stride()}")
        halves = layer.view(blocks, num_heads, 2, n * d)
        keys = halves[:, :, 0].view(blocks, num_heads, d, n).permute(0, 3, 1, 2)
        return keys, halves[:, :, 1].view(blocks, num_heads, n, d).transpose(1, 2)
    if fmt is KVCacheFormat.VLLM_MLA and num_heads != 1:
        raise ConfigError(f"vllm_mla KV is one latent head on every rank, got {num_heads} heads")
    row = (2 * d, num_heads * 2 * d)  # NHD, and MLA's latent rows
    inner = {KVCacheFormat.VLLM_HND: (n * 2 * d, 2 * d)}.get(fmt, row)
    strides = (layer.stride(1), layer.stride(2))
    if layer.stride(3) != 1 or any(
        size > 1 and got != want for size, got, want in zip((num_heads, n), strides, inner, strict=True)
    ):
        raise ConfigError(
            f"{fmt} KV of heads={num_heads}, block_size={n} has (head, position) strides {strides}; {fmt} stores "
            f"them as {inner} (is the engine's layout the other one of vllm_nhd / vllm_hnd?)"
        )
    tokens = layer.transpose(1, 2)  # [blocks, block_size, heads, 2*head_dim]
    return tokens[..., :d], tokens[..., d:]


def _paged(slots: torch.Tensor, fmt: KVCacheFormat, layout: KVLayout, num_heads: int) -> torch.Tensor:
    """A `[slots, heads, head_dim]` tensor viewed as `[pages, page_size, heads, head_dim]`."""
    _expect_shape(slots, (None, num_heads, layout.head_dim), fmt, "[slots, heads, head_dim]")
    if slots.shape[0] % layout.page_size:
        raise ConfigError(f"{fmt} KV has {slots.shape[0]} slots, not a whole number of pages of {layout.page_size}")
    return slots.view(-1, layout.page_size, *slots.shape[1:])


def _expect_shape(t: torch.Tensor, want: tuple[int | None, ...], fmt: KVCacheFormat, names: str) -> None:
    got = tuple(t.shape)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=True)):
        wanted = tuple("*" if w is None else w for w in want)
        raise ConfigError(f"{fmt} KV tensor has shape {got}, expected {names} = {wanted}")


def _check_view(view: torch.Tensor, shape: torch.Size, device: torch.device, layout: KVLayout) -> None:
    if view.shape != shape:
        raise ConfigError(f"KV views differ in shape: {tuple(view.shape)} and {tuple(shape)}")
    if view.device != device:
        raise ConfigError(f"KV tensors are on {view.device} and {device}; one rank's KV is on one device")
    dtype = torch_dtype(layout.dtype)
    same_bits = not view.dtype.is_floating_point and view.element_size() == layout.itemsize
    if view.dtype != dtype and not same_bits:
        raise ConfigError(f"KV tensor of {view.dtype} for a layout of {layout.dtype}")


def _canonical(view: torch.Tensor) -> torch.Tensor:
    """`view` with each size-1 axis given the stride it would have if contiguous over the axes after it (any stride
    addresses the same bytes there), so views of one layout compare equal whatever produced them."""
    strides = list(view.stride())
    for axis in reversed(range(view.dim())):
        if view.shape[axis] == 1:
            strides[axis] = strides[axis + 1] * view.shape[axis + 1] if axis + 1 < view.dim() else 1
    return view.as_strided(view.shape, strides, view.storage_offset())


def _max_word(views: Sequence[torch.Tensor], head_bytes: int) -> int:
    """Widest integer word that divides the head size, every view's address and every stride in bytes. A view whose
    head_dim axis is strided (vLLM CPU's K) is copied element by element: its word is the element."""
    for word in (8, 4, 2, 1):
        if head_bytes % word == 0 and all(_fits(view, word) for view in views):
            return word
    raise AssertionError("a word of one byte divides everything")


def _fits(view: torch.Tensor, word: int) -> bool:
    size = view.element_size()
    if view.stride(3) != 1:
        return word == size
    return view.data_ptr() % word == 0 and all(s * size % word == 0 for s in view.stride()[:3])


def _plane(view: torch.Tensor, word_bytes: int, part: tuple[int, int]) -> Plane:
    """`view` `[pages, page_size, heads, head_dim]` as integer words, merged to `[slots, heads, words]` if it can."""
    if view.stride(3) != 1 and word_bytes != view.element_size():
        raise InvalidRequest(
            f"a staging block aligned to {word_bytes} bytes cannot be copied element by element into KV of "
            f"{view.element_size()}-byte elements"
        )
    words = view.view(WORD_DTYPES[view.element_size()]).view(WORD_DTYPES[word_bytes])
    pages, page_size = words.shape[0], words.shape[1]
    if pages == 1 or page_size == 1 or words.stride(0) == page_size * words.stride(1):
        return Plane(words.view(pages * page_size, *words.shape[2:]), paged=False, axis=0, part=part)
    return Plane(words, paged=True, axis=0, part=part)
