"""The router when instances fail: failover, retries, breakers, probes, prefill fallbacks, the bootstrap down, the
client leaving early, and requests that vLLM turns into several engine requests. Real HTTP on loopback."""

from __future__ import annotations

import threading
import time

import anyio
import httpx
import pytest

from conftest import BODY, CHAT, closed_port_url, logged_errors, wait_until
from kvstage.router.instances import Instance, InstanceUnavailable, TPDirectory


@pytest.fixture
def pair(upstreams):
    return upstreams("P0", "prefill"), upstreams("D0", "decode")


@pytest.fixture
def trio(upstreams):
    return upstreams("P0", "prefill"), upstreams("D0", "decode"), upstreams("D1", "decode")


def _post(client: httpx.Client, url: str, body: dict | None = None) -> httpx.Response:
    return client.post(url + "/v1/completions", json=body or BODY)


def test_with_one_of_two_decodes_dead_every_request_succeeds_on_the_other(upstreams, start_router) -> None:
    prefill, alive = upstreams("P0", "prefill"), upstreams("D0", "decode")
    router = start_router([prefill.instance], [alive.instance, Instance("D1", "decode", closed_port_url())])
    with httpx.Client(timeout=10) as client:
        codes = [_post(client, router.url).status_code for _ in range(100)]
    assert codes.count(200) >= 99
    health = httpx.get(router.url + "/health", timeout=5).json()
    assert health["status"] == "degraded" and not next(i for i in health["instances"] if i["name"] == "D1")["up"]


def test_a_decode_that_dies_is_retried_around_with_a_new_room_until_its_breaker_opens(trio, start_router) -> None:
    prefill, d0, d1 = trio
    options = {"probe_interval_s": 3600.0, "breaker_failures": 3, "breaker_cooldown_s": 3600.0}
    router = start_router([prefill.instance], [d0.instance, d1.instance], **options)
    d1.close()  # dies after the router's first probe: only the requests find out
    with httpx.Client(timeout=10) as client:
        codes = [_post(client, router.url).status_code for _ in range(10)]
    assert codes == [200] * 10
    assert router.metric("kvstage_router_upstream_errors_total", role="decode", instance="D1", reason="connect") == 3
    assert router.metric("kvstage_router_retries_total", reason="connect") == 3
    assert router.metric("kvstage_router_breaker_state", role="decode", instance="D1") == 2  # open
    rooms = [r.room for r in d0.received]
    assert len(rooms) == len(set(rooms)) == 10  # a new room for every attempt


def test_a_decode_answering_500_is_retried_on_another_and_its_prefill_request_cancelled(trio, start_router) -> None:
    prefill, d0, d1 = trio
    prefill.mode, d0.mode = "hang", "error500"
    d0.needs_kv, d0.wait_for_peer = False, True  # fails only once prefill holds the room
    d1.needs_kv = False
    router = start_router([prefill.instance], [d0.instance, d1.instance])
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"].startswith("D1 answers")
    failed_room, room = d0.received[0].room, d1.received[0].room
    assert failed_room != room
    wait_until(lambda: failed_room in prefill.gone, "the first attempt's prefill request to be cancelled")
    assert router.metric("kvstage_router_retries_total", reason="http_5xx") == 1


def test_a_breaker_lets_one_trial_through_after_its_cooldown_and_closes_when_it_succeeds(trio, start_router) -> None:
    prefill, d0, d1 = trio
    d1.mode = "error500"
    options = {"probe_interval_s": 3600.0, "breaker_failures": 2, "breaker_cooldown_s": 0.3}
    router = start_router([prefill.instance], [d0.instance, d1.instance], **options)
    with httpx.Client(timeout=10) as client:
        wait_until(lambda: _post(client, router.url).status_code == 200 and _open(router, "D1"), "D1's breaker to open")
        d1.mode = "ok"
        seen = len(d1.received)
        wait_until(lambda: _post(client, router.url).status_code == 200 and len(d1.received) > seen, "a trial at D1")
        assert router.metric("kvstage_router_breaker_state", role="decode", instance="D1") == 0  # closed
        before = len(d1.received)
        for _ in range(4):
            assert _post(client, router.url).status_code == 200
    assert len(d1.received) - before == 2  # in turn again


def _open(router, decode: str) -> bool:
    return router.metric("kvstage_router_breaker_state", role="decode", instance=decode) == 2


def test_an_instance_whose_health_fails_is_skipped_until_it_answers_again(trio, start_router) -> None:
    prefill, d0, d1 = trio
    router = start_router([prefill.instance], [d0.instance, d1.instance], probe_interval_s=0.05)
    d1.healthy = False
    up = {"role": "decode", "instance": "D1"}
    wait_until(lambda: router.metric("kvstage_router_instance_up", **up) == 0, "the probe to find D1 down")
    with httpx.Client(timeout=10) as client:
        assert all(_post(client, router.url).status_code == 200 for _ in range(4))
        assert not d1.received
        d1.healthy = True
        wait_until(lambda: router.metric("kvstage_router_instance_up", **up) == 1, "the probe to find D1 up")
        assert all(_post(client, router.url).status_code == 200 for _ in range(4))
    assert len(d1.received) == 2


def test_with_the_bootstrap_down_concurrent_requests_do_not_wait_for_each_others_lookups(trio, start_router) -> None:
    prefill, d0, d1 = trio
    silent = closed_port_url().replace("http://", "tcp://")
    options = {"bootstrap": silent, "bootstrap_timeout_s": 2.0}
    router = start_router([prefill.instance], [d0.instance, d1.instance], **options)
    replies: list[httpx.Response] = []

    def post() -> None:
        replies.append(httpx.post(router.url + "/v1/completions", json=BODY, timeout=30))

    started = time.monotonic()
    clients = [threading.Thread(target=post) for _ in range(8)]
    for t in clients:
        t.start()
    metrics = httpx.get(router.url + "/metrics", timeout=5)  # the event loop is not blocked meanwhile
    assert metrics.status_code == 200 and time.monotonic() - started < 1.9  # less than one lookup's time
    for t in clients:
        t.join()
    assert time.monotonic() - started < 8.0  # a lookup's time (2 s) or two, not 8 of them in a row
    assert [r.status_code for r in replies] == [503] * 8
    assert {r.json()["error"]["reason"] for r in replies} == {"bootstrap"}
    assert not d0.received and not d1.received


def test_concurrent_lookups_of_an_instance_share_one(monkeypatch) -> None:
    silent = closed_port_url().replace("http://", "tcp://")
    unknown = Instance("D9", "decode", "http://127.0.0.1:1")
    directory = TPDirectory(silent, [unknown], timeout_s=0.5, retry_s=0.0)
    calls: list[float] = []
    lookup = directory._lookup_blocking

    def counted(instance: Instance) -> int:
        calls.append(time.monotonic())
        return lookup(instance)

    monkeypatch.setattr(directory, "_lookup_blocking", counted)
    failures: list[str] = []

    async def ask() -> None:
        try:
            await directory.tp_size(unknown)
        except InstanceUnavailable as exc:
            failures.append(exc.reason)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            await tasks.start(directory.run)
            first = len(calls)
            async with anyio.create_task_group() as requests:
                for _ in range(10):
                    requests.start_soon(ask)
            assert len(calls) - first <= 2  # the lookup under way, and perhaps the next one
            tasks.cancel_scope.cancel()

    anyio.run(main)
    assert failures == ["bootstrap"] * 10


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("refuse", {}),
        ("error500", {}),
        ("break", {}),
        ("hang", {"prefill_timeout_s": 0.5}),
        ("gone", {"probe_interval_s": 3600.0}),
    ],
    ids=["refuses", "answers_500", "breaks_the_connection", "times_out", "is_gone"],
)
def test_a_prefill_that_fails_before_decodes_first_byte_makes_decode_compute_it_within_seconds(
    pair, start_router, mode, options
) -> None:
    prefill, decode = pair  # decode waits for the room's KV, as vLLM's connector does
    router = start_router([prefill.instance], [decode.instance], **options)
    if mode == "gone":
        prefill.close()  # after the router's first probe: only the request finds out
    else:
        prefill.mode = mode
    started = time.monotonic()
    reply = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=5)
    assert reply.status_code == 200 and "t0" in reply.text
    assert time.monotonic() - started < 3.0
    *first, again = decode.received  # a prefill refused at once fails before decode's request with a room is sent
    assert "kv_transfer_params" not in again.body and len(first) <= 1
    wait_until(lambda: decode.gone == [r.room for r in first], "a decode request with the room to be cancelled")
    assert router.metric("kvstage_router_fallbacks_total", reason="prefill_failed") == 1


def test_a_prefill_that_refuses_the_request_makes_decode_compute_it_within_seconds(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode = "refuse"
    router = start_router([prefill.instance], [decode.instance])
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=5)
    assert reply.status_code == 200 and reply.elapsed.total_seconds() < 3.0
    assert router.metric("kvstage_router_upstream_errors_total", role="prefill", instance="P0", reason="http_4xx") == 1


def test_a_prefill_failing_after_decodes_first_byte_leaves_decode_alone(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode, prefill.delay_s = "error500", 0.2
    decode.needs_kv, decode.chunks, decode.chunk_delay_s = False, 3, 0.3  # answering before prefill fails
    router = start_router([prefill.instance], [decode.instance])
    with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
        text = reply.read().decode()
    assert text.count("text_completion") == 3 and text.endswith("data: [DONE]\n\n")
    assert len(decode.received) == 1 and not decode.gone
    assert router.metric("kvstage_router_fallbacks_total", reason="prefill_failed") == 0
    assert router.metric("kvstage_router_upstream_errors_total", role="prefill", instance="P0", reason="http_5xx") == 1


def test_a_request_gives_its_slot_back_once_decode_has_answered_and_cancels_prefill_still_running(
    pair, start_router
) -> None:
    prefill, decode = pair
    prefill.mode, decode.needs_kv = "hang", False
    router = start_router([prefill.instance], [decode.instance])
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "the slot to be given back")
    wait_until(lambda: prefill.gone == [decode.received[0].room], "the prefill request to be cancelled")


def test_a_client_leaving_before_decode_answers_leaves_no_error_and_gives_its_slot_back(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode = decode.mode = "hang"
    router = start_router([prefill.instance], [decode.instance])
    with logged_errors() as errors:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=BODY, timeout=0.5)
        room = decode.received[0].room
        wait_until(lambda: decode.gone == [room] and prefill.gone == [room], "both upstreams to see the client go")
        wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "the slot to be given back")
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    assert not errors, [r.getMessage() for r in errors]
    outcome = {"endpoint": "/v1/completions", "outcome": "client_disconnected"}
    assert router.metric("kvstage_router_requests_total", **outcome) == 1


def test_n_and_a_list_of_prompts_go_to_both_sides_with_n_kept(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    body = {**BODY, "prompt": ["hello", "there"], "n": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
    (to_prefill,), (to_decode,) = prefill.received, decode.received
    assert to_prefill.room == to_decode.room
    for got in (to_prefill, to_decode):
        assert got.body["n"] == 2 and got.body["prompt"] == ["hello", "there"]


def test_beam_search_is_served_by_decode_alone(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    body = {**BODY, "use_beam_search": True, "n": 2, "kv_transfer_params": {"kvstage_room": 5}}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
    assert not prefill.received
    assert "kv_transfer_params" not in decode.received[0].body and decode.received[0].body["use_beam_search"]
    assert router.metric("kvstage_router_fallbacks_total", reason="beam_search") == 1
