"""vLLM prefill and decode servers with the kvstage connector behind sglang-router (SMG), the router sglang users run:
`--pd-disaggregation --prefill URL PORT --decode URL`, each prefill given its own OpenAI port as its bootstrap port.
The router sends every request to both servers at once with its room (`bootstrap_room`); kvstage's middlewares turn
that into the connector's parameters (kvstage.integrations.vllm.sglang_router). Checked as the kvstage router's flow
is (test_vllm_e2e.py): the KV decode received is bit-exact against prefill's, and the text equals a single-instance
run, for completions and chat, whole and streamed; and prefill holds no block afterwards. (sglang-router takes text
prompts only: a list of token ids is refused with 422.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvstage.e2e.servers import ManagedProcess, free_port
from kvstage.e2e.verify import decode_rooms

from .conftest import Cluster
from .test_vllm_e2e import assert_bit_exact, complete, single_instance, wait_new_rooms
from .test_vllm_sequential import _wait_kv_cache_empty

pytest.importorskip("sglang_router", reason="sglang-router is not installed (the test extra installs it)")


@pytest.fixture(scope="module")
def sglang_router(cluster: Cluster) -> Iterator[str]:
    """sglang-router in front of P2 and D1; its URL."""
    prefill, decode = cluster.specs["P2"], cluster.specs["D1"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(prefill.port), "--decode", decode.url, "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-port", str(free_port()), "--policy", "random"]  # fmt: skip
    router = ManagedProcess("sglang-router", argv, cluster.logs / "sglang-router.log", url, _workers_healthy(url))
    router.start()
    try:
        router.wait_ready(120)
        yield url
    finally:
        router.stop()


def _workers_healthy(url: str) -> Callable[[], bool]:
    """Readiness of sglang-router: both of its workers registered and healthy (its /health answers before that)."""

    def probe() -> bool:
        try:
            workers = httpx.get(f"{url}/workers", timeout=2.0).json()["workers"]
        except (httpx.TransportError, ValueError, KeyError):
            return False
        return len(workers) == 2 and all(w.get("is_healthy") for w in workers)

    return probe


def test_a_request_through_sglang_router_gets_bit_exact_kv_and_the_single_instance_tokens(
    cluster: Cluster, spec, sglang_router: str
) -> None:
    words = [
        "staging",
        "ring",
        "prefill",
        "decode",
        "chunk",
        "room",
        "lease",
        "grant",
        "watermark",
        "scatter",
        "gather",
    ]
    prompts = [" ".join(words[(seed * 7 + i) % len(words)] for i in range(60 + 40 * seed)) for seed in range(3)]
    before = decode_rooms(cluster.reports)
    got = [complete(sglang_router, p) for p in prompts]
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, len(prompts)))
    assert got == [single_instance(cluster, "D1", p) for p in prompts]
    _wait_kv_cache_empty(cluster.url("P2"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_openai_client_through_sglang_router_gets_the_single_instance_text(
    cluster: Cluster, spec, sglang_router: str, chat: bool, stream: bool
) -> None:
    prompt = "sglang-router sends each request to prefill and to decode at once, with its room. " * 3
    before = decode_rooms(cluster.reports)
    got = complete(sglang_router, prompt, stream=stream, chat=chat)
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, 1))
    assert got == single_instance(cluster, "D1", prompt, chat=chat)
