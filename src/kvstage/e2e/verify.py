"""Reading what the connector's ranks reported (`kvstage.integrations.vllm.report`): KV bit-exactness per room,
and the ranks' counters.

Owns `check_rooms` (a room is verified when every span of tokens decode received has, for every layer, K/V and
global head, the digest prefill computed for it, and decode's ranks together cover every head of every span they
were sent; spans, not pages, so the two sides' block sizes may differ) and `read_counters` (each rank's last
counters line). Pure reading; called by the vLLM demo (kvstage.demo.vllm) and the end-to-end tests.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstage.layout import ceil_div


@dataclass(frozen=True, slots=True)
class RoomCheck:
    """The bit-exactness verdict of every room decode reported, and the prefix each one skipped."""

    verified: frozenset[int] = frozenset()
    mismatched: dict[int, str] = field(default_factory=dict)
    prefix_tokens: dict[int, int] = field(default_factory=dict)


def _records(folder: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return out


def decode_rooms(folder: Path) -> set[int]:
    """Rooms for which at least one decode rank reported its received KV."""
    return {r["room"] for r in _records(folder) if r["kind"] == "room" and r["role"] == "decode"}


def prefill_rooms(folder: Path) -> set[int]:
    """Rooms for which at least one prefill rank reported its digests: their last chunk is being handed over."""
    return {r["room"] for r in _records(folder) if r["kind"] == "room" and r["role"] == "prefill"}


def check_rooms(folder: Path, *, num_layers: int, num_kv_heads: int) -> RoomCheck:
    sent: dict[int, dict[str, str]] = defaultdict(dict)
    got: dict[int, dict[str, str]] = defaultdict(dict)
    prefix: dict[int, int] = {}
    num_tokens: dict[int, int] = {}
    span_tokens = 1
    for record in _records(folder):
        if record["kind"] != "room":
            continue
        (sent if record["role"] == "prefill" else got)[record["room"]].update(record["digests"])
        if record["role"] == "decode":
            prefix[record["room"]] = record["start_token"]
            num_tokens[record["room"]] = record["num_tokens"]
            span_tokens = record["span_tokens"]
    verified: set[int] = set()
    mismatched: dict[int, str] = {}
    for room, digests in got.items():
        spans = range(ceil_div(prefix[room], span_tokens), ceil_div(num_tokens[room], span_tokens))
        want = {
            f"{layer}.{kv}.{head}.{span}"
            for layer in range(num_layers)
            for kv in (0, 1)
            for head in range(num_kv_heads)
            for span in spans
        }
        if missing := want - digests.keys():
            mismatched[room] = f"decode reported no digest for {len(missing)} (layer, K/V, head, span) slices"
        elif unsent := want - sent.get(room, {}).keys():
            mismatched[room] = f"prefill reported no digest for {len(unsent)} (layer, K/V, head, span) slices"
        elif bad := [key for key in sorted(want) if sent[room].get(key) != digests[key]]:
            mismatched[room] = f"{len(bad)} slices differ from prefill's, first {bad[0]} (layer.kv.head.span)"
        else:
            verified.add(room)
    return RoomCheck(frozenset(verified), mismatched, prefix)


def read_counters(folder: Path) -> dict[tuple[str, str], dict[str, float]]:
    """Each rank's last counters line, keyed (role, file stem)."""
    last: dict[tuple[str, str], dict[str, float]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "counters":
                last[(record["role"], path.stem)] = {k: v for k, v in record.items() if k.startswith("kvstage_")}
    return last
