"""kvstage between real vLLM servers: prompts in, tokens out, across TP sizes, and what happens when things break.

Each request goes through the kvstage router to a prefill and a decode instance. A request is right when (a) the
KV decode received is bit-exact against prefill's (per-page digests the connector reports) and (b) its greedy
float32 tokens equal a single-instance run of the same prompt on the decode server (with its prefix cache
cleared first, so that the reference computes everything itself).
The tests that kill an instance come last in this file.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters

from .conftest import DEAD_AFTER_S, ROOM_TIMEOUT_S, Cluster

MAX_TOKENS = 12


def prompt_ids(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0, timeout=300.0)


def complete(url: str, prompt: list[int] | str, *, stream: bool = False, chat: bool = False) -> str:
    c = client(url)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = c.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,  # type: ignore[arg-type]
            )
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""
    if stream:
        chunks = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)
    return c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0).choices[0].text


def single_instance(cluster: Cluster, decode: str, prompt: list[int] | str, *, chat: bool = False) -> str:
    cluster.reset_prefix_cache(decode)
    return complete(cluster.url(decode), prompt, chat=chat)


def wait_new_rooms(
    cluster: Cluster, before: set[int], count: int, timeout_s: float = 30.0, folder: Path | None = None
) -> set[int]:
    """Rooms decode reported into `folder` (the cluster's reports by default) that are not in `before`."""
    folder = folder or cluster.reports
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = decode_rooms(folder) - before
        if len(new) >= count:
            return new
        time.sleep(0.1)
    raise AssertionError(f"decode reported {len(decode_rooms(folder) - before)} new rooms, expected {count}")


def assert_bit_exact(cluster: Cluster, spec, rooms: set[int]) -> None:
    check = check_rooms(cluster.reports, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads)
    assert not {r: check.mismatched[r] for r in rooms if r in check.mismatched}
    assert rooms <= check.verified


@pytest.mark.parametrize(
    ("prefill", "decode"), [("P2", "D1"), ("P1", "D2"), ("P1", "D1")], ids=["2to1", "1to2", "1to1"]
)
def test_a_request_through_the_router_gets_bit_exact_kv_and_the_single_instance_tokens(
    cluster: Cluster, spec, prefill: str, decode: str
) -> None:
    url = cluster.router(prefill, decode)
    prompts = [prompt_ids(seed) for seed in range(3)]
    before = decode_rooms(cluster.reports)
    got = [complete(url, p) for p in prompts]
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, len(prompts)))
    assert got == [single_instance(cluster, decode, p) for p in prompts]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_openai_client_gets_the_single_instance_text_for_completions_and_chat(
    cluster: Cluster, spec, chat: bool, stream: bool
) -> None:
    prompt = "The staging ring hands the KV cache from prefill to decode in one bulk write per writer. " * 3
    before = decode_rooms(cluster.reports)
    got = complete(cluster.router("P2", "D1"), prompt, stream=stream, chat=chat)
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, 1))
    assert got == single_instance(cluster, "D1", prompt, chat=chat)


def test_a_room_whose_prefill_never_comes_fails_and_vllm_recomputes_the_same_tokens(cluster: Cluster) -> None:
    prompt = prompt_ids(100)
    failures = _decode_failures(cluster)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "kv_transfer_params": {
            "kvstage_room": random.randrange(1, 2**63),
            "kvstage_peer": "ghost",
            "kvstage_peer_tp": 1,
        },
    }
    start = time.monotonic()
    reply = httpx.post(f"{cluster.url('D1')}/v1/completions", json=body, timeout=ROOM_TIMEOUT_S * 4)
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - start < ROOM_TIMEOUT_S * 3, "the failed room was not ended by its deadline"
    assert reply.json()["choices"][0]["text"] == single_instance(cluster, "D1", prompt)
    assert _decode_failures(cluster) > failures


def test_a_client_that_disconnects_mid_stream_ends_the_request_on_both_sides_and_leaks_nothing(
    cluster: Cluster, spec
) -> None:
    url = cluster.router("P2", "D1")
    body = {"model": "tiny", "prompt": prompt_ids(200), "max_tokens": 1500, "temperature": 0.0, "stream": True}
    with httpx.Client(timeout=120.0) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_bytes())  # the first tokens arrived: the KV handoff is done, decode is generating
    _wait_metric(url, 'kvstage_router_requests_total{endpoint="/v1/completions",outcome="client_disconnected"}', 1.0)
    # Decode stopped generating: the engine is free for the next request at once, and its ring holds nothing.
    prompt = prompt_ids(201)
    before = decode_rooms(cluster.reports)
    assert complete(url, prompt) == single_instance(cluster, "D1", prompt)
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, 1))
    # the ring gauge is refreshed at most every 10 ms (REFRESH_S), so the counters written as the room ended may
    # still show its last region: the ring must drain, not hold it at that instant
    _wait_ring_empty(cluster, "D1", url, timeout_s=10.0)


def test_z1_a_prefill_instance_killed_mid_transfer_leaves_decode_serving_and_nothing_leaked(
    cluster: Cluster, spec
) -> None:
    url = cluster.router("P1", "D2")
    prompts = [prompt_ids(300 + i, 1500) for i in range(4)]
    results: dict[int, object] = {}

    def send(i: int) -> None:
        try:
            results[i] = complete(url, prompts[i])
        except Exception as exc:  # noqa: BLE001 - the test records what the client saw, any kind of failure
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # prefill is computing the long prompts
    cluster.procs["P1"].kill()
    for t in threads:
        t.join(timeout=ROOM_TIMEOUT_S * 6)
    for i, outcome in results.items():
        if isinstance(outcome, str):  # recomputed by decode after its room failed, or handed off before the kill
            assert outcome == single_instance(cluster, "D2", prompts[i])
        else:  # a clear error from the router, naming what went wrong
            assert "P1" in str(outcome) or "decode" in str(outcome), outcome
    assert len(results) == len(prompts)
    # Decode still serves, with a live prefill instance, and its ring holds nothing.
    prompt = prompt_ids(399)
    before = decode_rooms(cluster.reports)
    assert complete(cluster.router("P2", "D2"), prompt) == single_instance(cluster, "D2", prompt)
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, 1))
    # The killed writer's ring regions stay quarantined until decode has declared it dead (R6): the router's
    # fallback answers the clients sooner than that now, so the ring empties within dead_after_s, not before.
    _wait_ring_empty(cluster, "D2", cluster.router("P2", "D2"), DEAD_AFTER_S * 3)


def test_z2_a_killed_decode_instance_gets_the_client_a_clear_error(cluster: Cluster) -> None:
    url = cluster.router("P2", "D2")
    cluster.procs["D2"].kill()
    reply = httpx.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt_ids(500), "max_tokens": 4}, timeout=60.0
    )
    assert reply.status_code in (502, 503), reply.text
    assert "D2" in reply.text


def _decode_failures(cluster: Cluster) -> float:
    return sum(
        c["kvstage_room_failures_total"] for (role, _), c in read_counters(cluster.reports).items() if role == "decode"
    )


def _wait_ring_empty(cluster: Cluster, decode: str, url: str, timeout_s: float) -> None:
    """Until `decode`'s ring holds nothing. Its counters are written when a room ends, so a short request through
    `url` every second renews them (the release of a quarantined region ends no room of its own)."""
    deadline = time.monotonic() + timeout_s
    while _ring_live_bytes(cluster, decode) and time.monotonic() < deadline:
        time.sleep(1.0)
        complete(url, prompt_ids(int(time.monotonic() * 1000), 20))
    assert _ring_live_bytes(cluster, decode) == 0, f"{decode}'s ring still holds bytes after {timeout_s} s"


def _ring_live_bytes(cluster: Cluster, decode: str) -> float:
    return sum(
        c["kvstage_ring_live_bytes"]
        for (role, stem), c in read_counters(cluster.reports).items()
        if f"-{decode}-" in stem
    )


def _wait_metric(url: str, line: str, value: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for row in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
            if row.startswith(line + " ") and float(row.split()[-1]) >= value:
                return
        time.sleep(0.2)
    raise AssertionError(f"{line} did not reach {value} within {timeout_s} s")
