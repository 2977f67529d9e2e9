"""How the router chooses instances, over real HTTP on loopback against recording OpenAI-style upstreams and a
real bootstrap: discovery (instances join and leave at runtime), load, prefix affinity, per-instance metrics."""

from __future__ import annotations

import logging
import threading

import httpx

from conftest import BODY, logged, peer_record, wait_until
from kvstage.transport.bootstrap import BootstrapClient

FAST = {"probe_interval_s": 0.2, "discover_poll_s": 0.1, "bootstrap_timeout_s": 0.5}


def post(url: str, body: dict | None = None) -> httpx.Response:
    reply = httpx.post(url + "/v1/completions", json=body or BODY, timeout=20)
    assert reply.status_code == 200, reply.text
    return reply


def register(bootstrap, fake, tp: int = 1) -> BootstrapClient:
    client = BootstrapClient(bootstrap.address)
    for rank in range(tp):
        client.register(peer_record(fake.name, fake.role, tp, rank, url=fake.url))
    return client


def test_discovered_instances_serve_once_registered_and_get_nothing_once_unregistered(
    bootstrap, upstreams, start_router
) -> None:
    router = start_router([], [], discover=True, **FAST)
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 503  # none yet
    prefill, decode = upstreams("PX", "prefill"), upstreams("DX", "decode")
    register(bootstrap, prefill, tp=2)
    client = register(bootstrap, decode)
    wait_until(lambda: httpx.get(router.url + "/health").status_code == 200, "DX to be discovered and probed")
    post(router.url)
    assert len(decode.received) == 1 and decode.received[0].body["kv_transfer_params"]["kvstage_peer"] == "PX"
    assert decode.received[0].body["kv_transfer_params"]["kvstage_peer_tp"] == 2
    later = upstreams("DY", "decode")
    register(bootstrap, later)
    wait_until(lambda: router.metric("kvstage_router_instance_up", role="decode", instance="DY") == 1, "DY")
    client.unregister("DX-0", 1)
    wait_until(lambda: "DX" not in {i["name"] for i in httpx.get(router.url + "/health").json()["instances"]}, "DX")
    for _ in range(3):
        post(router.url)
    assert len(decode.received) == 1 and len(later.received) == 3
    client.close()


def test_the_load_policy_sends_requests_past_a_decode_that_holds_requests_or_reports_a_queue(
    upstreams, start_router
) -> None:
    prefill, slow, quick = upstreams("P0", "prefill"), upstreams("D0", "decode"), upstreams("D1", "decode")
    router = start_router([prefill.instance], [slow.instance, quick.instance], policy="load", **FAST)
    slow.delay_s = 1.5
    held = threading.Thread(target=post, args=(router.url,))
    held.start()  # the first goes to D0 (equal loads: in turn) and stays there
    wait_until(lambda: slow.open == 1, "D0 to hold a request")
    for _ in range(4):
        post(router.url)
    assert len(quick.received) == 4 and len(slow.received) == 1
    held.join()
    slow.delay_s, quick.waiting = 0.0, 3.0  # D1's vLLM says 3 requests wait there
    wait_until(lambda: router.metric("kvstage_router_instance_waiting", role="decode", instance="D1") == 3, "a read")
    for _ in range(3):
        post(router.url)
    assert len(slow.received) == 4 and len(quick.received) == 4


def test_the_prefix_policy_keeps_a_prefix_on_one_decode_and_skips_prefill_when_it_holds_the_prompt(
    upstreams, start_router
) -> None:
    prefill = upstreams("P0", "prefill")
    d0, d1 = upstreams("D0", "decode"), upstreams("D1", "decode")
    router = start_router([prefill.instance], [d0.instance, d1.instance], policy="prefix", prefix_block_tokens=4)
    shared = list(range(16))
    for tail in range(4):
        post(router.url, {**BODY, "prompt": [*shared, *[100 + tail] * 5]})  # 4 shared blocks, 1 more, 1 token
    holder, other = (d0, d1) if d0.received else (d1, d0)
    assert len(holder.received) == 4 and not other.received
    wait_until(lambda: len(prefill.received) == 4, "4 prefill requests")
    post(router.url, {**BODY, "prompt": [*shared, *[100] * 5]})  # all of it held but one token: no prefill hop
    assert len(holder.received) == 5 and "kv_transfer_params" not in holder.received[-1].body
    assert router.metric("kvstage_router_fallbacks_total", reason="prefix_cached") == 1
    assert len(prefill.received) == 4


def test_a_hot_prefix_spreads_over_decodes_once_its_decode_holds_more_than_its_share(upstreams, start_router) -> None:
    prefill = upstreams("P0", "prefill")
    d0, d1 = upstreams("D0", "decode"), upstreams("D1", "decode")
    router = start_router(
        [prefill.instance], [d0.instance, d1.instance], policy="prefix", prefix_block_tokens=4, prefix_slack=0
    )
    d0.delay_s = d1.delay_s = 1.0
    threads = [threading.Thread(target=post, args=(router.url, {**BODY, "prompt": [*range(16), t]})) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the holder takes a request while its load stays within ceil(1.25 * (total + 1) / 2): 1, 2, -, 3, 4, -
    assert sorted([len(d0.received), len(d1.received)]) == [2, 4]


def test_the_router_counts_per_decode_instance_routed_requests_first_tokens_errors_and_kv_bytes(
    upstreams, start_router
) -> None:
    prefill, decode = upstreams("P0", "prefill"), upstreams("D0", "decode")
    # A counter: what it gains after the router's first read of it (with the decode's layout known) counts. It
    # reads 10 from the start, so that first read sees 10 whenever it comes (once in CI it came after the posts).
    decode.external_tokens = 10.0
    router = start_router([prefill.instance], [decode.instance], **FAST)
    for _ in range(2):
        post(router.url)  # answered: the router has looked the decode's TP size and layout up

    def probes() -> float:
        return router.metric("kvstage_router_probes_total", role="decode", instance="D0", result="up")

    seen = probes()
    wait_until(lambda: probes() >= seen + 2, "a probe round that read the decode's metrics after the posts")
    decode.external_tokens = 30.0
    token_bytes = 2 * 2 * 4 * 8 * 4  # K and V, 2 layers, 4 heads of 8 float32 (conftest.LAYOUT)
    wait_until(lambda: router.metric("kvstage_router_kv_bytes_total", instance="D0") == 20 * token_bytes, "KV bytes")
    assert router.metric("kvstage_router_routed_total", role="decode", instance="D0") == 2
    assert router.metric("kvstage_router_ttft_seconds_count", instance="D0") == 2
    assert router.metric("kvstage_router_instance_in_flight", role="decode", instance="D0") == 0
    decode.mode = "error500"
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 502
    errors = router.metric("kvstage_router_upstream_errors_total", role="decode", instance="D0", reason="http_5xx")
    assert errors == 1


def test_while_the_bootstrap_is_down_discovered_instances_keep_serving(bootstrap, upstreams, start_router) -> None:
    router = start_router([], [], discover=True, **FAST)
    prefill, decode = upstreams("PX", "prefill"), upstreams("DX", "decode")
    register(bootstrap, prefill).close()
    register(bootstrap, decode).close()
    wait_until(lambda: httpx.get(router.url + "/health").status_code == 200, "DX to be discovered and probed")
    bootstrap.close()
    with logged(logging.WARNING) as warnings:
        wait_until(lambda: any("does not answer" in r.getMessage() for r in warnings), "the warning", 15.0)
    post(router.url)
    assert len(decode.received) == 1
