"""The router's own HTTP API over real HTTP on loopback: the OpenAI error shape for every status, request ids, the
client key and the upstream key, and client-sent kvstage keys."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from conftest import BODY, CHAT


@pytest.fixture
def pair(upstreams):
    return upstreams("P0", "prefill"), upstreams("D0", "decode")


def _assert_openai_error(reply: httpx.Response, status: int) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert re.fullmatch(r"[0-9a-f]{32}", reply.headers["x-request-id"])


def test_every_error_the_router_answers_has_the_openai_shape_and_a_request_id(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance], max_body_bytes=4096)
    with httpx.Client(base_url=router.url, timeout=10) as client:
        _assert_openai_error(client.get("/nope"), 404)
        _assert_openai_error(client.get("/v1/completions"), 405)
        _assert_openai_error(client.post("/v1/completions", json={**BODY, "prompt": "x" * 5000}), 413)
        _assert_openai_error(client.post("/v1/completions", content=b"[1]"), 400)
        decode.mode = "refuse"
        refused = client.post("/v1/chat/completions", json=CHAT)
        _assert_openai_error(refused, 400)
        assert refused.json()["error"]["instance"] == "D0" and refused.json()["error"]["reason"] == "http_4xx"


def test_a_clients_request_id_goes_to_both_upstreams_comes_back_and_names_the_request_in_the_log(
    pair, start_router, caplog
) -> None:
    prefill, decode = pair
    prefill.mode = "error500"  # something to log
    router = start_router([prefill.instance], [decode.instance])
    caplog.set_level(logging.INFO, "kvstage.router")
    reply = httpx.post(router.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "client-id-1"}, timeout=10)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "client-id-1"
    assert [r.headers["x-request-id"] for r in (*prefill.received, *decode.received)] == ["client-id-1"] * 3
    about = [r.getMessage() for r in caplog.records if "room" in r.getMessage()]
    assert about and all("request client-id-1:" in line for line in about)


@pytest.mark.parametrize("given", ["x" * 129, "two words", "caf\u00e9"], ids=["too_long", "space", "not_ascii"])
def test_a_request_id_that_is_too_long_or_not_printable_is_replaced(pair, start_router, given) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    headers = [("x-request-id", given.encode())]
    reply = httpx.post(router.url + "/v1/completions", json=BODY, headers=headers, timeout=10)
    made = reply.headers["x-request-id"]
    assert reply.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", made)
    assert prefill.received[0].headers["x-request-id"] == decode.received[0].headers["x-request-id"] == made


def test_with_an_api_key_v1_needs_it_and_only_the_upstream_key_goes_upstream(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance], api_key="client-key", upstream_api_key="vllm-key")
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "client-key"}):
            refused = client.post("/v1/completions", json=BODY, headers=headers)
            _assert_openai_error(refused, 401)
            assert refused.headers["www-authenticate"] == "Bearer"
        _assert_openai_error(client.get("/v1/models"), 401)
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        good = {"Authorization": "Bearer client-key"}
        assert client.post("/v1/completions", json=BODY, headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
    sent = [r.headers.get("authorization") for r in (*prefill.received, *decode.received)]
    assert sent == ["Bearer vllm-key"] * 2
    assert router.metric("kvstage_router_unauthorized_total") == 4


def test_without_keys_the_clients_authorization_goes_to_no_upstream(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    headers = {"Authorization": "Bearer the-clients-own"}
    assert httpx.post(router.url + "/v1/completions", json=BODY, headers=headers, timeout=10).status_code == 200
    assert all("authorization" not in r.headers for r in (*prefill.received, *decode.received))


def test_kvstage_keys_a_client_puts_in_vllm_xargs_reach_neither_upstream(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    xargs = {"kvstage_room": 7, "kvstage_peer": "evil", "kvstage_peer_tp": 8, "mine": "kept"}
    body = {**BODY, "vllm_xargs": xargs, "kvstage_room": 9}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
    for got in (*prefill.received, *decode.received):
        assert got.body["vllm_xargs"] == {"mine": "kept"} and "kvstage_room" not in got.body
        assert got.room not in (7, 9)
