"""`kvstage router --discover` over the real vLLM cluster: the instances it routes to are the ones registered with
the bootstrap (each server publishes its OpenAI URL with its records), as they come and go."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from kvstage.e2e.servers import ManagedProcess, start_router
from kvstage.e2e.verify import decode_rooms

from .conftest import Cluster
from .test_vllm_e2e import assert_bit_exact, complete, prompt_ids, single_instance, wait_new_rooms

#: A decode that serves is routed to within this, and one stopped gets no new request after it (issue 24).
WITHIN_S = 10.0


def discovering_router(cluster: Cluster, *flags: str) -> ManagedProcess:
    log = cluster.logs / f"router-discover-{len(cluster.routers)}-{time.monotonic_ns()}.log"
    args = ("--discover", "--probe-interval", "0.5", *flags)
    router = start_router(cluster.bootstrap.url, [], [], log, args)
    router.wait_ready(60.0)
    return router


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain `labels`, from the router's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    pattern = rf"^{name}(\{{[^}}]*\}})? ([0-9.e+]+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M) if labels in (m.group(1) or ""))


def routed(url: str, instance: str) -> float:
    return metric(url, "kvstage_router_routed_total", f'instance="{instance}",role="decode"')


def listed(url: str) -> set[str]:
    return {i["name"] for i in httpx.get(f"{url}/health", timeout=10.0).json()["instances"]}


def test_a_discovering_router_finds_the_cluster_and_hands_off_bit_exact(cluster: Cluster, spec) -> None:
    router = discovering_router(cluster)
    try:
        assert {"P2", "P1", "D1", "D2"} <= listed(router.url)
        prompts = [prompt_ids(4100 + i) for i in range(4)]
        before = decode_rooms(cluster.reports)
        got = [complete(router.url, p) for p in prompts]
        assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, len(prompts)))
        assert got == [single_instance(cluster, "D1", p) for p in prompts]
        assert routed(router.url, "D1") > 0 and routed(router.url, "D2") > 0
    finally:
        router.stop()


@pytest.mark.slow
def test_a_decode_started_after_the_router_serves_within_10_s_and_once_stopped_gets_nothing_after_10_s(
    cluster: Cluster,
) -> None:
    """Slow: starting one more vLLM server takes about a minute on two cores."""
    router = discovering_router(cluster)
    try:
        cluster.start("D3", "decode", 1)
        ready = time.monotonic()
        while routed(router.url, "D3") == 0:
            assert time.monotonic() - ready < WITHIN_S, f"D3 got no request {WITHIN_S} s after it served"
            complete(router.url, prompt_ids(4200))
        print(f"D3 routed to {time.monotonic() - ready:.1f} s after it served")  # seen with -s
        cluster.procs["D3"].stop()
        stopped = time.monotonic()
        while "D3" in listed(router.url):
            assert time.monotonic() - stopped < WITHIN_S, "the stopped D3 is still listed"
            time.sleep(0.2)
        print(f"D3 left the router's pools {time.monotonic() - stopped:.1f} s after it stopped")  # seen with -s
        retries = metric(router.url, "kvstage_router_retries_total")
        for i in range(6):  # a request sent to the stopped D3 would fail there and be tried again elsewhere
            complete(router.url, prompt_ids(4300 + i, 40))
        assert metric(router.url, "kvstage_router_retries_total") == retries
    finally:
        router.stop()
