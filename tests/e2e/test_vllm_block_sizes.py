"""Prefill and decode with different vLLM block sizes (issue 23), end to end on the session's cluster: D32 (and P32,
in the slow test) use blocks of 32 tokens, the other instances vLLM CPU's default of 128 (conftest.py).

Every request is verified (the KV decode received is bit-exact against prefill's, per 16-token span, and the
greedy tokens equal a single-instance run), and none is recomputed: the rooms of both instances fail none
(`kvstage_room_failures_total` of their ranks stays where it was).
"""

from __future__ import annotations

import pytest

from kvstage.e2e.model import TinyModelSpec
from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters

from .conftest import SMALL_BLOCKS_PREFILL, Cluster
from .test_vllm_e2e import assert_bit_exact, complete, prompt_ids, single_instance, wait_new_rooms


def room_failures(cluster: Cluster, *instances: str) -> float:
    """Failed rooms on every rank of `instances`, from the counters they last reported."""
    return sum(
        counters["kvstage_room_failures_total"]
        for (_, stem), counters in read_counters(cluster.reports).items()
        if any(f"-{name}-" in stem for name in instances)
    )


def hand_off_verified(cluster: Cluster, spec: TinyModelSpec, prefill: str, decode: str, hit: int) -> None:
    """Three prompts through a router in front of `prefill` and `decode`, the second sharing 300 tokens with the
    first, so that decode's prefix cache holds `hit` of them (whole decode blocks) and the room starts there: every
    request verified, none recomputed."""
    url = cluster.router(prefill, decode)
    cluster.reset_prefix_cache(decode)
    first = prompt_ids(600, 400)
    prompts = [first, first[:300] + prompt_ids(601, 150), prompt_ids(602, 333)]
    failures = room_failures(cluster, prefill, decode)
    before = decode_rooms(cluster.reports)
    got = [complete(url, p) for p in prompts]
    rooms = wait_new_rooms(cluster, before, len(prompts))
    assert_bit_exact(cluster, spec, rooms)
    check = check_rooms(cluster.reports, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads)
    assert sorted(check.prefix_tokens[room] for room in rooms) == [0, 0, hit]
    assert room_failures(cluster, prefill, decode) == failures
    assert got == [single_instance(cluster, decode, p) for p in prompts]


def test_prefill_of_128_token_blocks_hands_off_to_decode_of_32_every_request_verified_and_none_recomputed(
    cluster: Cluster, spec: TinyModelSpec, small_blocks: tuple[str, ...]
) -> None:
    # D32 caches 288 of the shared 300 tokens (9 blocks): the room starts inside one of P2's 128-token blocks
    hand_off_verified(cluster, spec, "P2", "D32", 288)


@pytest.mark.slow  # starts one more vLLM server on its own (about a minute on 2 cores)
def test_prefill_of_32_token_blocks_hands_off_to_decode_of_128_at_matched_tp_staged_and_verified(
    cluster: Cluster, spec: TinyModelSpec
) -> None:
    name, role, tp, fields = SMALL_BLOCKS_PREFILL
    if name not in cluster.specs:
        cluster.start(name, role, tp, **fields)
    hand_off_verified(cluster, spec, name, "D1", 256)  # matched TP, but other block sizes: staged
