"""The e2e reports' digests (`span_digests`) name token spans, not blocks: the same tokens in caches of different
block sizes, in any block order, digest alike; one changed element changes one span's digest only. A room checked
before every prefill rank reported is named incomplete, not different (`check_rooms`)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstage.dataplane import EngineKV, KVCacheFormat
from kvstage.e2e.verify import check_rooms
from kvstage.integrations.vllm.report import SPAN_TOKENS, RankReport, span_digests
from kvstage.layout import KVLayout

TOKENS, START = 300, 96


def _cache(block_size: int, blocks: list[int], values: torch.Tensor) -> EngineKV:
    layout = KVLayout(2, 2, 8, "float32", block_size)
    whole = torch.zeros(2, max(blocks) + 1, 2, block_size, 16)
    kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, [whole[i] for i in range(2)], 2)
    for token in range(TOKENS):
        block, position = blocks[token // block_size], token % block_size
        for layer in range(2):
            kv.k(layer)[block, position] = values[0, layer, token]
            kv.v(layer)[block, position] = values[1, layer, token]
    return kv


def test_the_same_tokens_in_caches_of_different_block_sizes_digest_alike_span_by_span() -> None:
    values = torch.randn(2, 2, TOKENS, 2, 8, generator=torch.Generator().manual_seed(0))
    small = [3, 1, 0, 2, 5, 4, 7, 6, 9, 8]
    large = [2, 0, 3]
    digests = span_digests(_cache(32, small, values), [0, 1], small, TOKENS, START)
    assert digests == span_digests(_cache(128, large, values), [0, 1], large, TOKENS, START)
    assert len(digests) == 2 * 2 * 2 * (19 - START // 16)  # layers x K/V x heads x spans 6..18 (the last short)
    values[1, 0, 200, 1, 3] += 1.0  # V, layer 0, token 200 (span 12), head 1
    changed = span_digests(_cache(32, small, values), [0, 1], small, TOKENS, START)
    assert {key for key in digests if digests[key] != changed[key]} == {"0.1.1.12"}


def _room(report: RankReport, heads: range, spans: range) -> None:
    digests = {f"0.{kv}.{head}.{span}": f"{head}{span}" for kv in (0, 1) for head in heads for span in spans}
    report.room(7, spans.stop * SPAN_TOKENS, 0, digests)


def test_a_room_whose_prefill_rank_has_not_reported_yet_is_named_missing_not_different(tmp_path: Path) -> None:
    _room(RankReport(str(tmp_path), "decode", "D2", 0), range(0, 1), range(2))
    _room(RankReport(str(tmp_path), "decode", "D2", 1), range(1, 2), range(2))
    _room(RankReport(str(tmp_path), "prefill", "P2", 0), range(0, 1), range(2))
    check = check_rooms(tmp_path, num_layers=1, num_kv_heads=2)
    assert check.mismatched == {7: "prefill reported no digest for 4 (layer, K/V, head, span) slices"}
    _room(RankReport(str(tmp_path), "prefill", "P2", 1), range(1, 2), range(2))
    assert check_rooms(tmp_path, num_layers=1, num_kv_heads=2).verified == {7}
