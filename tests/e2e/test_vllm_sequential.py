"""vLLM's sequential PD flow over the kvstage connector, driven by a minimal proxy written from vLLM's documented
flow (its disaggregated-serving proxy and client examples): the prompt goes to prefill alone, with
`kv_transfer_params: {"do_remote_decode": true}` and one token; the `kv_transfer_params` of prefill's answer go to
decode with the request. No kvstage router. Each request is verified as the router's are (test_vllm_e2e.py): the KV
decode received is bit-exact against prefill's, and the tokens equal a single-instance run; and prefill holds no
block once decode took the KV.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from kvstage.e2e.verify import decode_rooms

from .conftest import ROOM_TIMEOUT_S, Cluster
from .test_vllm_e2e import MAX_TOKENS, assert_bit_exact, prompt_ids, single_instance, wait_new_rooms

#: What vLLM's proxy examples send prefill: the remote fields are filled in by prefill's answer.
ASK_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def sequential_proxy(prefill_url: str, decode_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One completion the way vLLM's documented PD proxies make it: prefill first, then decode with prefill's
    kv_transfer_params (without them, decode computes the prompt itself)."""
    first = {**body, "kv_transfer_params": ASK_PREFILL, "max_tokens": 1, "stream": False}
    first.pop("stream_options", None)
    answer = httpx.post(f"{prefill_url}/v1/completions", json=first, timeout=120.0)
    answer.raise_for_status()
    second = dict(body)
    if params := answer.json().get("kv_transfer_params"):
        second["kv_transfer_params"] = params
    reply = httpx.post(f"{decode_url}/v1/completions", json=second, timeout=120.0)
    reply.raise_for_status()
    return {"text": reply.json()["choices"][0]["text"], "handed_off": params}


@pytest.mark.parametrize(("prefill", "decode"), [("P2", "D1"), ("P1", "D2")], ids=["2to1", "1to2"])
def test_the_sequential_flow_gets_bit_exact_kv_and_the_single_instance_tokens_and_frees_prefills_blocks(
    cluster: Cluster, spec, prefill: str, decode: str
) -> None:
    prompts = [prompt_ids(600 + seed, 200 + 90 * seed) for seed in range(3)]
    before = decode_rooms(cluster.reports)
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0.0}
    got = [sequential_proxy(cluster.url(prefill), cluster.url(decode), {**body, "prompt": p}) for p in prompts]
    for reply in got:
        assert reply["handed_off"]["kvstage_peer"] == prefill, reply
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, len(prompts)))
    assert [reply["text"] for reply in got] == [single_instance(cluster, decode, p) for p in prompts]
    _wait_kv_cache_empty(cluster.url(prefill))


def _wait_kv_cache_empty(url: str, timeout_s: float = ROOM_TIMEOUT_S + 10.0) -> None:
    """Until vLLM's `kv_cache_usage_perc` of the instance at `url` is 0: no block is held for anyone. The instance
    is shared with the session's other tests, some of whose rooms hold blocks until their deadline on purpose
    (ROOM_TIMEOUT_S), so the wait covers one room timeout; this test's own rooms ended before it starts."""
    deadline = time.monotonic() + timeout_s
    usage = -1.0
    while time.monotonic() < deadline:
        rows = httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines()
        usage = sum(float(row.split()[-1]) for row in rows if row.startswith("vllm:kv_cache_usage_perc"))
        if usage == 0.0:
            return
        time.sleep(0.2)
    raise AssertionError(f"{url} still holds {usage:.3%} of its KV cache {timeout_s} s after the requests ended")
