"""Prefill and decode with different vLLM block sizes (issue 23), end to end on the session's cluster: P32 and D32
use blocks of 32 tokens, the other instances vLLM CPU's default of 128 (conftest.py, `small_blocks`).

Every request is verified (the KV decode received is bit-exact against prefill's, per 16-token span, and the
greedy tokens equal a single-instance run), and none is recomputed: the rooms of both instances fail none
(`kvstage_room_failures_total` of their ranks stays where it was).
"""

from __future__ import annotations

import pytest

from kvstage.e2e.model import TinyModelSpec
from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters

from .conftest import Cluster
from .test_vllm_e2e import assert_bit_exact, complete, prompt_ids, single_instance, wait_new_rooms


def room_failures(cluster: Cluster, *instances: str) -> float:
    """Failed rooms on every rank of `instances`, from the counters they last reported."""
    return sum(
        counters["kvstage_room_failures_total"]
        for (_, stem), counters in read_counters(cluster.reports).items()
        if any(f"-{name}-" in stem for name in instances)
    )


@pytest.mark.parametrize(
    ("prefill", "decode"), [("P2", "D32"), ("P32", "D1")], ids=["prefill128-decode32", "prefill32-decode128"]
)
def test_prefill_and_decode_of_different_block_sizes_hand_off_every_request_verified_and_none_recomputed(
    cluster: Cluster, spec: TinyModelSpec, small_blocks: tuple[str, ...], prefill: str, decode: str
) -> None:
    url = cluster.router(prefill, decode)
    cluster.reset_prefix_cache(decode)
    first = prompt_ids(600, 400)
    # shares 300 tokens with `first`: decode's prefix cache holds whole blocks of them (288 tokens on D32, 256 on
    # D1), so the room starts there; on D32 that is inside one of P2's 128-token blocks
    prompts = [first, first[:300] + prompt_ids(601, 150), prompt_ids(602, 333)]
    failures = room_failures(cluster, prefill, decode)
    before = decode_rooms(cluster.reports)
    got = [complete(url, p) for p in prompts]
    rooms = wait_new_rooms(cluster, before, len(prompts))
    assert_bit_exact(cluster, spec, rooms)
    check = check_rooms(cluster.reports, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads)
    assert sorted(check.prefix_tokens[room] for room in rooms) == [0, 0, 288 if decode == "D32" else 256]
    assert room_failures(cluster, prefill, decode) == failures
    assert got == [single_instance(cluster, decode, p) for p in prompts]
