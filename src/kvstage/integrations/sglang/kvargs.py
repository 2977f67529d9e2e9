"""sglang's `KVArgs` turned into what a kvstage agent takes: the model's `KVLayout` and an `EngineKV` over the
very memory of sglang's KV pool, plus readers and writers of one row of its aux (metadata) buffers.

Owns `RankKV` and `rank_kv`, `AuxRows`. sglang hands a transfer backend raw pointers, not tensors (`KVArgs`:
`kv_data_ptrs` = every layer's K buffer, then every layer's V buffer, each `[slots, heads, head_dim]`; for an MLA
model's pool, every layer's one latent buffer `[slots, 1, kv_lora_rank + rope_dim]`, the same on every TP rank;
`kv_item_lens` = the bytes of one page of one buffer; `aux_data_ptrs` = one buffer per aux field, a row per
request). An MLA latent is moved as kvstage moves vLLM's (`latent_layout`, format `vllm_mla`): one head every
rank holds whole, so each decode rank takes it from one prefill rank. Tensors are made over those pointers without
a copy (host memory through ctypes; CUDA through `__cuda_array_interface__`, not run here), and the buffers must
outlive the agent, which sglang's pool does.

Refused with `ConfigError` at start (never per request): hybrid state (mamba, SWA, DSA: `state_types`),
speculative draft KV (`num_draft_entries`), pipeline parallelism, a dtype kvstage does not move, buffers whose
lengths disagree, an aux row larger than the protocol carries (`Limits.max_aux_bytes`). Pure apart from reading and
writing the aux rows; called by manager.py.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvstage.dataplane import EngineKV
from kvstage.dataplane.engine_kv import KVCacheFormat
from kvstage.errors import ConfigError
from kvstage.layout import DTYPE_BYTES, KVLayout, latent_layout

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32", "fp8_e4m3": "float8_e4m3fn",
           "float8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RankKV:
    """One rank's KV as kvstage sees it."""

    layout: KVLayout
    kv: EngineKV
    num_heads: int


def kv_dtype(name: str) -> str:
    """kvstage's name of sglang's `kv_cache_dtype_str` (e.g. "bfloat16", "fp8_e4m3")."""
    dtype = _DTYPES.get(name.lower().removeprefix("torch."))
    if dtype is None:
        raise ConfigError(f"sglang KV dtype {name!r} is not one kvstage moves ({', '.join(sorted(DTYPE_BYTES))})")
    return dtype


def host_bytes(ptr: int, nbytes: int, device: str) -> torch.Tensor:
    """A uint8 tensor over `nbytes` at `ptr` on `device`, sharing the memory (no copy)."""
    if device == "cpu":
        buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    holder = type("_Cuda", (), {})()
    holder.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
    return torch.as_tensor(holder, device=device)


def _refuse_unsupported(args: Any) -> None:
    if getattr(args, "state_types", None):
        raise ConfigError(f"kvstage's sglang backend moves plain KV only; this pool has state {args.state_types}")
    if getattr(args, "num_draft_entries", 0):
        raise ConfigError("kvstage's sglang backend does not move speculative draft KV")
    if getattr(args, "pp_rank", 0):
        raise ConfigError("kvstage's sglang backend does not support pipeline parallelism")


def rank_kv(args: Any, is_mla: bool, device: str) -> RankKV:
    """The layout and `EngineKV` of sglang's `KVArgs` `args` (`device`: where the pool lives)."""
    _refuse_unsupported(args)
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    if is_mla:
        return _latent_kv(ptrs, lens, items, args, device)
    if not ptrs or len(ptrs) % 2 or len(lens) != len(ptrs) or len(items) != len(ptrs):
        raise ConfigError(f"sglang gave {len(ptrs)} KV buffers; kvstage expects K and V of every layer")
    dtype, page, heads = kv_dtype(args.kv_cache_dtype_str), int(args.page_size), int(args.kv_head_num)
    token_bytes = items[0] // page
    head_dim = token_bytes // (heads * DTYPE_BYTES[dtype])
    if set(items) != {items[0]} or set(lens) != {lens[0]} or head_dim * heads * DTYPE_BYTES[dtype] != token_bytes:
        raise ConfigError(f"sglang's KV buffers are not alike (item bytes {set(items)}, lengths {set(lens)})")
    layers = len(ptrs) // 2
    layout = KVLayout(layers, int(args.total_kv_head_num), head_dim, dtype, page)
    torch_dtype = getattr(torch, dtype)
    slots = lens[0] // token_bytes

    def view(ptr: int) -> torch.Tensor:
        return host_bytes(ptr, lens[0], device).view(torch_dtype).view(slots, heads, head_dim)

    pairs = [(view(ptrs[i]), view(ptrs[layers + i])) for i in range(layers)]
    return RankKV(layout, EngineKV.from_layers(layout, KVCacheFormat.SGLANG, pairs, heads), heads)


def _latent_kv(ptrs: list[int], lens: list[int], items: list[int], args: Any, device: str) -> RankKV:
    """An MLA pool: one latent buffer `[slots, 1, row]` per layer, viewed as vLLM's latent cache
    `[pages, 1, page_size, row]` over the same memory."""
    if not ptrs or len(lens) != len(ptrs) or len(items) != len(ptrs) or set(items) != {items[0]} or len(set(lens)) != 1:
        raise ConfigError(f"sglang's MLA buffers are not one alike latent buffer per layer (items {set(items)})")
    dtype, page = kv_dtype(args.kv_cache_dtype_str), int(args.page_size)
    row = items[0] // (page * DTYPE_BYTES[dtype])
    slots = lens[0] // (row * DTYPE_BYTES[dtype])
    if row * page * DTYPE_BYTES[dtype] != items[0] or slots % page:
        raise ConfigError(f"sglang's MLA buffer of {lens[0]} bytes is not whole pages of {page} rows of {row}")
    layout = latent_layout(len(ptrs), row, dtype, page)
    torch_dtype = getattr(torch, dtype)
    layers = [
        host_bytes(p, lens[0], device).view(torch_dtype).view(slots // page, page, 1, row).transpose(1, 2) for p in ptrs
    ]
    return RankKV(layout, EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, layers, 1), 1)


@dataclass(frozen=True, slots=True)
class AuxRows:
    """sglang's aux (metadata) buffers: one row per request slot in each; the rows are host memory."""

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    items: tuple[int, ...]

    @classmethod
    def of(cls, args: Any, max_row_bytes: int) -> AuxRows:
        """sglang's aux buffers of `args`; `ConfigError` if a row is over `max_row_bytes` (the protocol's bound of the
        aux row that rides the room's last chunk, `Limits.max_aux_bytes`)."""
        rows = cls(tuple(args.aux_data_ptrs), tuple(args.aux_data_lens), tuple(args.aux_item_lens))
        if rows.row_bytes > max_row_bytes:
            raise ConfigError(f"sglang's aux row takes {rows.row_bytes} bytes; kvstage carries {max_row_bytes} at most")
        return rows

    @property
    def row_bytes(self) -> int:
        return sum(self.items)

    def holds(self, index: int) -> bool:
        """Whether row `index` lies inside every buffer."""
        return all(0 <= index and (index + 1) * item <= n for item, n in zip(self.items, self.lens, strict=True))

    def _check(self, index: int) -> None:
        if not self.holds(index):
            raise IndexError(f"aux index {index} is outside sglang's metadata buffers")

    def read(self, index: int) -> bytes:
        """Row `index` of every buffer, concatenated."""
        self._check(index)
        return b"".join(ctypes.string_at(p + index * item, item) for p, item in zip(self.ptrs, self.items, strict=True))

    def write(self, index: int, row: bytes) -> None:
        """Write `row` (as `read` returns it) into row `index` of every buffer."""
        self._check(index)
        if len(row) != self.row_bytes:
            raise ValueError(f"aux row of {len(row)} bytes, sglang's buffers take {self.row_bytes}")
        offset = 0
        for p, item in zip(self.ptrs, self.items, strict=True):
            ctypes.memmove(p + index * item, row[offset : offset + item], item)
            offset += item
