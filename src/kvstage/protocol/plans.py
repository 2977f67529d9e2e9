"""Per-room plans, computed once and cached: path choice, writer targets, staging plans and head transfers.

Owns the memoised views of layout.py that the endpoints need on every room (never per message). The caches
are bounded (`functools.lru_cache`), keyed by small hashable values (KVLayout is a frozen dataclass). Pure.
Called by decode.py and prefill.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from kvstage.layout import HeadTransfer, KVLayout, StagingPlan, plan_head_transfers, plan_staging
from kvstage.protocol.messages import DIRECT, STAGED, Path


def choose_path(attention: str, prefill_tp: int, decode_tp: int, staged_only: bool = False) -> Path:
    """R12: MLA rooms and rooms with matched TP go page to page; every other room stages, and so does every
    `staged_only` room (the decode rank's KV cannot be written page to page by these writers: it exports none, or
    theirs is laid out otherwise)."""
    return DIRECT if not staged_only and (attention == "mla" or prefill_tp == decode_tp) else STAGED


@lru_cache(maxsize=1024)
def idle_writers(num_kv_heads: int, prefill_tp: int, decode_tp: int, turn: int = 0) -> tuple[int, ...]:
    """The prefill ranks that write to no decode rank (replicated heads, or an MLA latent, from a larger prefill TP)."""
    writers = {t.prefill_rank for t in plan_head_transfers(num_kv_heads, prefill_tp, decode_tp, turn)}
    return tuple(rank for rank in range(prefill_tp) if rank not in writers)


@lru_cache(maxsize=4096)
def staging_plan(
    layout: KVLayout, prefill_tp: int, decode_tp: int, decode_rank: int, num_tokens: int, turn: int = 0
) -> StagingPlan:
    """`plan_staging`, memoised: every chunk of a room but the last shares one plan (`turn`: `replica_turn`)."""
    return plan_staging(layout, prefill_tp, decode_tp, decode_rank, num_tokens, turn)


@lru_cache(maxsize=1024)
def transfers_of_writer(
    num_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int, turn: int = 0
) -> Mapping[int, HeadTransfer]:
    """Decode rank -> the one head run `prefill_rank` writes to it (ranks it writes nothing to are absent).

    plan_head_transfers merges contiguous runs and gives each (writer, decode rank) pair one run; a staging
    block is one run, so a second run would be a layout bug and raises."""
    runs: dict[int, HeadTransfer] = {}
    for t in plan_head_transfers(num_kv_heads, prefill_tp, decode_tp, turn):
        if t.prefill_rank == prefill_rank:
            if t.decode_rank in runs:
                raise AssertionError(f"prefill rank {prefill_rank} has two head runs to decode rank {t.decode_rank}")
            runs[t.decode_rank] = t
    return runs
