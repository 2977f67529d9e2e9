"""Matched TP sizes under vLLM (issue 23): P1 -> D1 and P2 -> D2 write decode's own vLLM blocks page run to page
run, straight from prefill's blocks (the local backend's cross-memory writes), with no staging ring: no gather on
prefill, no scatter on decode, and the bytes moved are exactly the rooms' whole (layer, block)s. Every request is
verified (KV bit-exact, tokens equal to a single-instance run). The numbers are printed (pytest -s).
"""

from __future__ import annotations

import time

import pytest

from kvstage.e2e.model import TinyModelSpec
from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters
from kvstage.layout import ceil_div

from .conftest import Cluster
from .test_vllm_e2e import assert_bit_exact, complete, prompt_ids, single_instance, wait_new_rooms

BLOCK = 128  # the cluster's vLLM block size (vLLM CPU's default)
CHUNK = 256  # the connector's chunk for it (the smallest multiple of the block size >= 256)


def counters(cluster: Cluster, instance: str) -> dict[str, float]:
    """The counters of every rank of `instance`, summed."""
    total: dict[str, float] = {}
    for (_, stem), values in read_counters(cluster.reports).items():
        if f"-{instance}-" in stem:
            for name, value in values.items():
                total[name] = total.get(name, 0.0) + value
    return total


def delta(cluster: Cluster, instance: str, since: dict[str, float], name: str) -> float:
    return counters(cluster, instance).get(name, 0.0) - since.get(name, 0.0)


@pytest.mark.parametrize(("prefill", "decode"), [("P1", "D1"), ("P2", "D2")], ids=["1to1", "2to2"])
def test_matched_tp_rooms_write_decodes_vllm_blocks_page_to_page_with_no_ring_byte(
    cluster: Cluster, spec: TinyModelSpec, prefill: str, decode: str
) -> None:
    url = cluster.router(prefill, decode)
    cluster.reset_prefix_cache(decode)
    prompts = [prompt_ids(710, 300), prompt_ids(711, 520), prompt_ids(712, 129)]
    sent, got_before = counters(cluster, prefill), counters(cluster, decode)
    before = decode_rooms(cluster.reports)
    got = [complete(url, p) for p in prompts]
    rooms = wait_new_rooms(cluster, before, len(prompts))
    assert_bit_exact(cluster, spec, rooms)
    prefix = check_rooms(cluster.reports, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads).prefix_tokens
    tokens = [len(p) for p in prompts]
    assert sorted(prefix[room] for room in rooms) == [0, 0, 0]
    blocks = sum(ceil_div(n, BLOCK) for n in tokens)
    chunks = sum(ceil_div(n, CHUNK) for n in tokens)
    # each (layer, block) of every KV head, K and V, float32: the rooms' blocks, whole
    block_bytes = spec.num_kv_heads * 2 * BLOCK * spec.head_dim * 4
    want = blocks * spec.num_layers * block_bytes
    deadline = time.monotonic() + 30.0  # prefill's ranks report their counters when their rooms end
    while delta(cluster, prefill, sent, "kvstage_transfer_bytes_total") < want and time.monotonic() < deadline:
        time.sleep(0.2)
    moved = delta(cluster, prefill, sent, "kvstage_transfer_bytes_total")
    ops = delta(cluster, prefill, sent, "kvstage_transfer_ops_total")
    high_water = counters(cluster, decode)["kvstage_ring_high_water_bytes"]
    print(f"\n{prefill} -> {decode}: {len(rooms)} rooms, {blocks} blocks, {chunks} chunks: {moved:.0f} bytes in "
          f"{ops:.0f} writes; decode's ring high water {high_water:.0f}")  # fmt: skip
    assert moved == want
    # one write per contiguous run: at most one per (layer, block) and rank, at least one per layer, chunk and rank
    tp = 1 if prefill == "P1" else 2
    assert spec.num_layers * chunks * tp <= ops <= spec.num_layers * blocks * tp
    assert delta(cluster, prefill, sent, "kvstage_copy_seconds_count") == 0  # no gather into staging
    assert delta(cluster, decode, got_before, "kvstage_copy_seconds_count") == 0  # no scatter out of a ring
    assert counters(cluster, decode)["kvstage_ring_live_bytes"] == 0
    assert got == [single_instance(cluster, decode, p) for p in prompts]
