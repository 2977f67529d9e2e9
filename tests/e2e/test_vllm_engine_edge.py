"""The engine edge (issue 21): what clients can send to, and what can happen to, the vLLM servers around kvstage,
end to end on the session's cluster (tests/e2e/conftest.py).

- a decode server given malformed kvstage params answers them as a single instance would, and lives on; the
  router never lets a client's kvstage keys through;
- requests that vLLM splits into several (`n` > 1, a list of prompts) get the single-instance choices, in time;
- prefill preempting its own requests (a tiny KV cache, concurrent long prompts) costs recomputes, never the
  engine or the tokens;
- a dead prefill instance the router still lists costs the client seconds, not the room deadline;
- with two decode instances behind a router, one killed, the router serves on with the other.

A text is right when it equals a single-instance run of the same body on the decode server, with its prefix cache
cleared first. Every wait is bounded. The tests that kill a server, or may leave one dead, are named `test_z...`
and run after the folder's other tests (conftest.py); they kill PS (the cluster's small prefill, which only this
module uses) and D2 (which test_z2 kills anyway), and the last one sends D1 itself what killed its engine.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from typing import Any

import httpx
import pytest

from kvstage.e2e.model import TinyModelSpec
from kvstage.e2e.verify import check_rooms, decode_rooms

from .conftest import DEAD_AFTER_S, ROOM_TIMEOUT_S, Cluster
from .test_vllm_e2e import MAX_TOKENS, assert_bit_exact, prompt_ids, single_instance, wait_new_rooms

#: A request that vLLM splits into several must answer within this (today they stall).
SPLIT_TIMEOUT_S = 60.0
#: Longest wait for one request that may meet a failed room (the room deadline, and then a recompute).
REQUEST_TIMEOUT_S = ROOM_TIMEOUT_S + 15.0
#: Time to first token allowed with a dead prefill instance: the issue's bar is 10 s (the room deadline was 120 s);
#: half of the test servers' DEAD_AFTER_S, so that waiting out a dead peer's liveness cannot pass it.
DEAD_PREFILL_TTFT_S = DEAD_AFTER_S / 2


def post(url: str, body: dict[str, Any], timeout_s: float) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=timeout_s)


def texts(reply: httpx.Response) -> list[str]:
    assert reply.status_code == 200, reply.text
    return [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]


def no_mismatch(cluster: Cluster, spec: TinyModelSpec, rooms: set[int]) -> None:
    check = check_rooms(cluster.reports, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads)
    assert not {r: check.mismatched[r] for r in rooms if r in check.mismatched}


# ---- what clients send ------------------------------------------------------------------------------------------


def test_kvstage_keys_a_client_sends_through_the_router_never_reach_vllm(cluster: Cluster, spec: TinyModelSpec) -> None:
    url = cluster.router("P2", "D1")
    prompt = prompt_ids(2100, 200)
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "kv_transfer_params": {"kvstage_room": "abc"},
        "vllm_xargs": {"kvstage_room": -1, "kvstage_peer": "P1", "kvstage_peer_tp": 0},
    }
    before = decode_rooms(cluster.reports)
    got = texts(post(url, body, REQUEST_TIMEOUT_S))
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, 1))
    assert got == [single_instance(cluster, "D1", prompt)]
    cluster.assert_serving("P2", "D1")


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_n_2_through_the_router_gets_the_single_instance_choices_in_time(
    cluster: Cluster, spec: TinyModelSpec, sampling: str
) -> None:
    url = cluster.router("P2", "D1")
    prompt = prompt_ids(2200, 200)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": MAX_TOKENS, "n": 2}
    # vLLM refuses n > 1 at temperature 0 (HTTP 400, also on one instance): top_k=1 is greedy in effect.
    body.update({"temperature": 1.0, "top_k": 1} if sampling == "greedy" else {"temperature": 1.0, "seed": 2201})
    before = decode_rooms(cluster.reports)
    try:
        got = texts(post(url, body, SPLIT_TIMEOUT_S))
    except httpx.TimeoutException:
        pytest.fail(f"n=2 through the router: no answer within {SPLIT_TIMEOUT_S:.0f} s")
    no_mismatch(cluster, spec, decode_rooms(cluster.reports) - before)
    if sampling == "greedy":
        assert got == [single_instance(cluster, "D1", prompt)] * 2
    else:
        cluster.reset_prefix_cache("D1")
        assert got == texts(post(cluster.url("D1"), body, SPLIT_TIMEOUT_S))
    cluster.assert_serving("P2", "D1")


def test_a_list_of_prompts_through_the_router_gets_the_single_instance_text_of_each_in_time(
    cluster: Cluster, spec: TinyModelSpec
) -> None:
    url = cluster.router("P2", "D1")
    prompts = [prompt_ids(2300, 200), prompt_ids(2301, 200)]
    before = decode_rooms(cluster.reports)
    try:
        got = texts(post(url, {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0.0}, SPLIT_TIMEOUT_S))
    except httpx.TimeoutException:
        pytest.fail(f"a list of 2 prompts through the router: no answer within {SPLIT_TIMEOUT_S:.0f} s")
    no_mismatch(cluster, spec, decode_rooms(cluster.reports) - before)
    assert got == [single_instance(cluster, "D1", p) for p in prompts]
    cluster.assert_serving("P2", "D1")


# ---- what happens to the servers --------------------------------------------------------------------------------


def test_long_prompts_that_preempt_each_other_on_prefill_get_the_single_instance_text_and_prefill_lives(
    cluster: Cluster, small_prefill: str
) -> None:
    url = cluster.router(small_prefill, "D1")
    preemptions = _preemptions(cluster, small_prefill)
    # 5 blocks each, prefill holds 9: through the router (which staggers arrivals a little) 5 such prompts preempted
    # once per batch in 2 of 2 tries and 0 times in 1, straight to prefill 3-5 times; 8 leave no room for luck
    prompts = [prompt_ids(2400 + i, 600) for i in range(8)]
    results: dict[int, object] = {}

    def send(i: int) -> None:
        try:
            results[i] = texts(
                post(url, {"prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0.0}, REQUEST_TIMEOUT_S)
            )[0]
        except Exception as exc:  # noqa: BLE001 - the test records what the client saw, any kind of failure
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120.0)
    cluster.assert_serving(small_prefill, "D1")
    assert _preemptions(cluster, small_prefill) > preemptions, "prefill did not preempt: the test proves nothing"
    assert [results.get(i) for i in range(len(prompts))] == [single_instance(cluster, "D1", p) for p in prompts]


def test_z1b_a_dead_prefill_the_router_still_lists_costs_the_client_seconds_not_the_room_deadline(
    cluster: Cluster, small_prefill: str
) -> None:
    url = cluster.router(small_prefill, "D1")
    cluster.kill(small_prefill)
    prompts = [prompt_ids(2500 + i, 200) for i in range(5)]
    ttft: list[float] = []
    got: list[str] = []
    for prompt in prompts:
        first, text = _streamed(url, prompt)
        ttft.append(first)
        got.append(text)
        if sum(t > DEAD_PREFILL_TTFT_S for t in ttft) > len(prompts) // 2:
            break  # the median is decided
    print(f"times to first token with a dead prefill listed (s): {[round(t, 2) for t in ttft]}")  # seen with -s
    assert statistics.median(ttft) <= DEAD_PREFILL_TTFT_S, f"times to first token (s): {[round(t, 1) for t in ttft]}"
    assert got == [single_instance(cluster, "D1", p) for p in prompts[: len(got)]]
    cluster.assert_serving("D1")


def test_z1c_with_two_decodes_behind_the_router_and_one_killed_99_of_the_next_100_requests_succeed(
    cluster: Cluster,
) -> None:
    url = cluster.router("P2", "D1", "D2")
    prompts = [prompt_ids(2600 + i, 24) for i in range(4)]
    expected = [single_instance(cluster, "D1", p) for p in prompts]

    def body(i: int) -> dict[str, Any]:
        return {"prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS, "temperature": 0.0}

    for i in range(2):  # one request to each decode: both serve through this router
        assert texts(post(url, body(i), 60.0)) == [expected[i]]
    cluster.kill("D2")
    ok, failures = 0, []
    deadline = time.monotonic() + 180.0
    for i in range(100):
        if time.monotonic() > deadline:
            break
        try:
            reply = post(url, body(i), 30.0)
        except httpx.HTTPError as exc:
            failures.append(f"#{i}: {exc!r}")
            continue
        if reply.status_code != 200:
            failures.append(f"#{i}: HTTP {reply.status_code} {reply.text[:160]}")
        elif texts(reply) != [expected[i % len(prompts)]]:
            failures.append(f"#{i}: wrong text")
        else:
            ok += 1
    unsent = 100 - ok - len(failures)
    print(f"one of two decodes killed: {ok} of 100 succeeded")  # seen with -s
    assert ok >= 99, f"{ok} of 100 succeeded, {unsent} not sent within 180 s; the first failures: {failures[:3]}"
    cluster.assert_serving("P2", "D1")


def test_z3_malformed_kvstage_params_straight_to_decode_get_the_single_instance_text_and_decode_lives(
    cluster: Cluster, spec: TinyModelSpec
) -> None:
    prompt = prompt_ids(2700, 40)
    expected = single_instance(cluster, "D1", prompt)
    malformed: list[dict[str, object]] = [
        {"kvstage_room": "abc"},
        {"kvstage_room": 5},
        {"kvstage_room": -1, "kvstage_peer": "P1", "kvstage_peer_tp": 0},
        {"kvstage_room": random.randrange(1, 2**63), "kvstage_peer": "P1", "kvstage_peer_tp": 10**9},
    ]
    outcomes: list[str] = []
    for params in malformed:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "kv_transfer_params": params}
        try:
            reply = post(cluster.url("D1"), body, REQUEST_TIMEOUT_S)
        except httpx.HTTPError as exc:
            outcomes.append(f"{params}: {exc!r}")
            continue
        if reply.status_code != 200:
            outcomes.append(f"{params}: HTTP {reply.status_code} {reply.text[:160]}")
        else:
            outcomes.append("ok" if texts(reply) == [expected] else f"{params}: wrong text")
    assert outcomes == ["ok"] * len(malformed), outcomes
    cluster.assert_serving("D1")
    # ... and decode still takes KV through kvstage.
    prompt = prompt_ids(2701, 200)
    before = decode_rooms(cluster.reports)
    assert texts(
        post(
            cluster.router("P2", "D1"),
            {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0},
            REQUEST_TIMEOUT_S,
        )
    ) == [single_instance(cluster, "D1", prompt)]
    assert_bit_exact(cluster, spec, wait_new_rooms(cluster, before, 1))
    cluster.assert_serving("P2", "D1")


def _preemptions(cluster: Cluster, name: str) -> int:
    """Rooms the connector of that server reclaimed at a preemption, from its log (each worker logs one line per
    room). vLLM's own `vllm:num_preemptions_total` stayed at 0 in runs through the router whose log showed rooms
    reclaimed (the prefill requests end after one token), so it cannot tell."""
    return (cluster.logs / f"{name}.log").read_text(errors="replace").count(" preempted: room ")


def _streamed(url: str, prompt: list[int]) -> tuple[float, str]:
    """A streamed completion through the router: seconds from sending to the first text, and the whole text."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    start, first, parts = time.monotonic(), None, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as reply:
        assert reply.status_code == 200, reply.read().decode(errors="replace")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            text = "".join(c["text"] for c in chunk.get("choices", []))
            if text and first is None:
                first = time.monotonic() - start
            parts.append(text)
    assert first is not None, "no text came"
    return first, "".join(parts)
