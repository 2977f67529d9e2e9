"""What a rank reports for end-to-end checks: per-span digests of the KV it sent or received, and its counters.

Owns `span_digests` (one 64-bit BLAKE2b digest per (layer, K/V, global head, span of `SPAN_TOKENS` tokens of the
request), read straight from the engine's own KV tensors), `agent_counters` (an agent's transfer and ring
counters, summed over its Prometheus samples) and `RankReport`, which appends one JSON line per room (digests) and
per outcome (counters) to a file of its rank.
Keys name global heads and token spans, not pages, so digests from ranks of different TP sizes and different
block sizes compare directly: decode's digest of a span equals prefill's exactly when the bytes are equal. Span `i`
holds tokens [i * SPAN_TOKENS, (i + 1) * SPAN_TOKENS), so decode's prefix-cache hit simply starts at a later span.

Called by the connector's worker side (`worker.py`) when `report_dir` is set; read by `kvstage.e2e.verify`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from kvstage.dataplane.engine_kv import EngineKV
from kvstage.layout import ceil_div

#: Tokens of one digested span: a divisor of every block size vLLM takes, so spans never mix a decode prefix-cache
#: hit (whole decode blocks) with received tokens.
SPAN_TOKENS = 16


def span_digests(
    kv: EngineKV, global_heads: Sequence[int], blocks: Sequence[int], num_tokens: int, start_token: int
) -> dict[str, str]:
    """Digests of the spans of tokens [start_token, num_tokens) of a request whose tokens live in `blocks`, keyed
    `"layer.kv.global_head.span"`; a span that starts before `start_token` is left out, the last one is short."""
    page_size, block_ids = kv.layout.page_size, torch.tensor(blocks, dtype=torch.int64)
    out: dict[str, str] = {}
    for span in range(ceil_div(start_token, SPAN_TOKENS), ceil_div(num_tokens, SPAN_TOKENS)):
        tokens = torch.arange(span * SPAN_TOKENS, min((span + 1) * SPAN_TOKENS, num_tokens))
        pages = block_ids[tokens // page_size]
        for layer in range(kv.layout.num_layers):
            for kv_index, view in enumerate((kv.k(layer), kv.v(layer))):
                rows = view[pages, tokens % page_size]  # [tokens, heads, head_dim], a copy
                for local, head in enumerate(global_heads):
                    data = rows[:, local].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                    out[f"{layer}.{kv_index}.{head}.{span}"] = hashlib.blake2b(data, digest_size=8).hexdigest()
    return out


#: Counters a rank reports (sums over the agent's samples of each metric).
COUNTERS = (
    "kvstage_transfer_bytes_total",
    "kvstage_transfer_ops_total",
    "kvstage_transfer_busy_seconds_total",
    "kvstage_room_failures_total",
    "kvstage_ring_high_water_bytes",
    "kvstage_ring_live_bytes",
    "kvstage_copy_seconds_count",  # gathers (prefill) or scatters (decode): one per staged chunk and writer block
    "kvstage_ring_canary_violations_total",
)


def agent_counters(registry: CollectorRegistry) -> dict[str, float]:
    """The `COUNTERS` of one agent's registry, each summed over its labels (0 where the role has none)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


class RankReport:
    """Appends `{"kind": "room", "room", "role", "rank", "num_tokens", "start_token", "span_tokens", "digests"}` and
    `{"kind": "counters", "role", "rank", ...COUNTERS}` lines to one file per rank (the last counters line is
    the rank's state)."""

    def __init__(self, folder: str, role: str, instance: str, rank: int) -> None:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self._path = path / f"{role}-{instance}-{rank}.jsonl"
        self._role = role
        self._rank = rank
        self._lock = threading.Lock()

    def room(self, room: int, num_tokens: int, start_token: int, digests: dict[str, str]) -> None:
        self._append(
            {
                "kind": "room",
                "room": room,
                "role": self._role,
                "rank": self._rank,
                "num_tokens": num_tokens,
                "start_token": start_token,
                "span_tokens": SPAN_TOKENS,
                "digests": digests,
            }
        )

    def counters(self, registry: CollectorRegistry) -> None:
        self._append({"kind": "counters", "role": self._role, "rank": self._rank, **agent_counters(registry)})

    def _append(self, record: dict[str, object]) -> None:
        line = json.dumps(record)
        with self._lock, self._path.open("a") as f:
            f.write(line + "\n")
