"""An MLA model (the tiny DeepSeek-V2, vLLM's CPU MLA backend) between real vLLM servers: its latent cache, one
head every TP rank holds whole, goes from one prefill rank to each decode rank. A request is right when the latent
rows decode received are bit-exact against prefill's and its greedy tokens equal a single-instance run on decode.
Both are slow (--run-slow): the P2 -> D1 pair starts after the session cluster (`mla_pair`), P1 -> D2 starts a
pair of its own. The default suite covers the MLA path below vLLM's servers: tests/runtime/test_mla_engine_kv.py
(agents over vLLM-shaped latent caches) and tests/dataplane/test_engine_kv_vllm_mla.py (vLLM's own latent write).
"""

from __future__ import annotations

import pytest

from kvstage.e2e.model import MODELS
from kvstage.e2e.servers import start_vllm
from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters

from .conftest import START_TIMEOUT_S, Cluster
from .test_vllm_e2e import complete, prompt_ids, wait_new_rooms

SPEC = MODELS["deepseek-tiny"]


def _handoffs_are_verified(cluster: Cluster, prefill: str, decode: str) -> None:
    url = cluster.router(prefill, decode)
    prompts = [prompt_ids(seed, 200 + 37 * seed) for seed in range(3)]
    before = decode_rooms(cluster.mla_reports)
    got = [complete(url, p) for p in prompts]
    rooms = wait_new_rooms(cluster, before, len(prompts), folder=cluster.mla_reports)
    check = check_rooms(cluster.mla_reports, num_layers=SPEC.num_layers, num_kv_heads=SPEC.kv_heads)
    assert not {r: check.mismatched[r] for r in rooms if r in check.mismatched}
    assert rooms <= check.verified
    failures = sum(c["kvstage_room_failures_total"] for c in read_counters(cluster.mla_reports).values())
    assert failures == 0  # every room handed off: none recomputed
    cluster.reset_prefix_cache(decode)
    assert got == [complete(cluster.url(decode), p) for p in prompts]


@pytest.mark.slow  # two more vLLM servers (an MLA pair alone: 53-183 s to start on 2 cores)
def test_an_mla_models_latent_kv_goes_from_prefill_tp2_to_decode_tp1_bit_exact_with_the_same_tokens(
    cluster: Cluster, mla_pair: tuple[str, str]
) -> None:
    _handoffs_are_verified(cluster, *mla_pair)


@pytest.mark.slow
def test_an_mla_models_latent_kv_goes_from_prefill_tp1_to_both_decode_ranks_of_tp2(cluster: Cluster) -> None:
    for name, role, tp in (("MP1", "prefill", 1), ("MD2", "decode", 2)):
        cluster.specs[name] = cluster.mla_spec(name, role, tp)
        cluster.procs[name] = start_vllm(cluster.specs[name], cluster.logs)
    for name in ("MP1", "MD2"):
        cluster.procs[name].wait_ready(START_TIMEOUT_S)
    _handoffs_are_verified(cluster, "MP1", "MD2")
