"""The router over real HTTP on loopback, against recording OpenAI-style upstreams and a real bootstrap."""

from __future__ import annotations

import json
import socket
import threading
from unittest.mock import ANY

import httpx
import openai
import pytest

from conftest import BODY, CHAT, DECODE_TP, PREFILL_TP, closed_port_url, peer_record, register_instances, wait_until
from kvstage.router.instances import Instance
from kvstage.transport.bootstrap import BootstrapClient, BootstrapServer


def arrived(fake, count: int) -> list:
    """The requests `fake` received, once there are `count` (prefill's may land after decode has answered)."""
    wait_until(lambda: len(fake.received) >= count, f"{count} requests at {fake.name}")
    return fake.received


@pytest.fixture
def pair(upstreams):
    return upstreams("P0", "prefill"), upstreams("D0", "decode")


def test_both_sides_get_one_room_and_each_other_as_peer(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    client_body = {**BODY, "kv_transfer_params": {"kvstage_room": 7, "kvstage_peer": "evil"}}
    reply = httpx.post(router.url + "/v1/completions", json=client_body, timeout=10)
    assert reply.status_code == 200, reply.text
    (to_prefill,), (to_decode,) = arrived(prefill, 1), decode.received
    room = to_decode.room
    assert 1 <= room < 2**63 and room != 7
    assert to_prefill.body["kv_transfer_params"] == {"kvstage_room": room, "kvstage_peer": "D0", "kvstage_peer_tp": 1}
    assert to_decode.body["kv_transfer_params"] == {"kvstage_room": room, "kvstage_peer": "P0", "kvstage_peer_tp": 2}
    assert {k: v for k, v in to_decode.body.items() if k != "kv_transfer_params"} == BODY
    assert to_prefill.body["max_tokens"] == 1 and to_prefill.body["stream"] is False
    assert reply.json()["choices"][0]["text"] == f"D0 answers room {room}"
    wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "the slot to be given back")
    assert router.metric("kvstage_router_requests_total", endpoint="/v1/completions", outcome="ok") == 1


def test_chat_prefill_is_one_unstreamed_token_and_decode_streams_as_asked(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=10) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = reply.read().decode()
    to_prefill = arrived(prefill, 1)[0].body
    assert to_prefill["max_tokens"] == 1 and to_prefill["max_completion_tokens"] == 1
    assert to_prefill["stream"] is False and "stream_options" not in to_prefill and "min_tokens" not in to_prefill
    assert decode.received[0].body["stream_options"] == {"include_usage": True}
    assert text.count("chat.completion.chunk") == 3 and text.endswith("data: [DONE]\n\n")


def test_prefill_and_decode_are_requested_at_once(pair, start_router) -> None:
    prefill, decode = pair
    prefill.wait_for_peer = decode.wait_for_peer = True  # each answers only once the other has the room
    router = start_router([prefill.instance], [decode.instance])
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 200, reply.text
    wait_until(lambda: router.metric("kvstage_router_prefill_seconds_count") == 1, "prefill to succeed")
    assert abs(prefill.received[0].at - decode.received[0].at) < 1.0


def test_stream_is_relayed_chunk_by_chunk_as_decode_sends_it(pair, start_router) -> None:
    prefill, decode = pair
    decode.chunks, decode.chunk_delay_s = 4, 0.3
    router = start_router([prefill.instance], [decode.instance])
    with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
        # how many chunks decode had sent when each one reached the client
        sent_when_received = [decode.sent_chunks for line in reply.iter_lines() if line.startswith("data: {")]
    assert len(sent_when_received) == 4
    assert sent_when_received[0] < 4  # the first chunk reached the client before decode had sent them all
    assert router.metric("kvstage_router_first_byte_seconds_count", endpoint="/v1/completions") == 1


def test_client_disconnect_mid_stream_cancels_both_upstreams(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode, decode.mode = "hang", "hang_stream"
    decode.needs_kv = False  # decode streams while prefill still hangs
    router = start_router([prefill.instance], [decode.instance])
    with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
        next(reply.iter_bytes())  # the first chunk arrived; then the client goes away
    room = decode.received[0].room
    wait_until(lambda: decode.gone == [room], "decode to see the client go")
    wait_until(lambda: prefill.gone == [room], "prefill to see the client go")
    wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "the slot to be given back")
    assert (
        router.metric("kvstage_router_requests_total", endpoint="/v1/completions", outcome="client_disconnected") == 1
    )


def test_decode_breaking_off_a_stream_ends_it_with_an_error_event(pair, start_router) -> None:
    prefill, decode = pair
    decode.mode = "break_stream"
    router = start_router([prefill.instance], [decode.instance])
    with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert len(events) == 2 and "text_completion" in events[0]
    error = json.loads(events[1])["error"]
    assert error["instance"] == "D0" and error["reason"] == "protocol"
    wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "the request to end")
    assert router.metric("kvstage_router_requests_total", endpoint="/v1/completions", outcome="decode_error") == 1


def test_dead_decode_is_a_503_naming_the_instance_and_the_reason(upstreams, start_router) -> None:
    prefill = upstreams("P0", "prefill")
    prefill.mode = "hang"
    router = start_router([prefill.instance], [Instance("D0", "decode", closed_port_url())])
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["instance"] == "D0" and error["reason"] == "connect" and "'D0'" in error["message"]
    assert not prefill.received  # the probe found D0 down before the request came: nothing was sent
    assert router.metric("kvstage_router_probes_total", role="decode", instance="D0", result="down") >= 1
    assert router.metric("kvstage_router_requests_total", endpoint="/v1/completions", outcome="decode_unavailable") == 1


def test_decode_500_is_a_502_carrying_the_upstream_message(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode, decode.mode = "hang", "error500"
    # fails only once prefill holds the room: then prefill's request must be cancelled
    decode.needs_kv, decode.wait_for_peer = False, True
    router = start_router([prefill.instance], [decode.instance])
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["instance"] == "D0" and error["reason"] == "http_5xx" and "boom from D0" in error["message"]
    wait_until(lambda: prefill.gone == [decode.received[0].room], "the prefill request to be cancelled")


def test_unregistered_decode_is_a_503_naming_the_bootstrap(upstreams, start_router, bootstrap) -> None:
    prefill, decode = upstreams("P0", "prefill"), upstreams("D9", "decode")
    router = start_router([prefill.instance], [decode.instance])
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["instance"] == "D9" and error["reason"] == "unregistered" and bootstrap.address in error["message"]
    assert not decode.received and not prefill.received


def test_prefill_failure_is_counted_and_the_client_still_gets_decodes_answer(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode = "error500"
    router = start_router([prefill.instance], [decode.instance])
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"].startswith("D0 answers")
    labels = {"role": "prefill", "instance": "P0", "reason": "http_5xx"}
    assert router.metric("kvstage_router_upstream_errors_total", **labels) == 1


def test_dead_prefill_does_not_fail_the_client(upstreams, start_router) -> None:
    decode = upstreams("D0", "decode")
    router = start_router([Instance("P0", "prefill", closed_port_url())], [decode.instance])
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 200
    assert "kv_transfer_params" not in decode.received[0].body  # decode computed it alone
    assert router.metric("kvstage_router_fallbacks_total", reason="no_prefill") == 1


def test_requests_beyond_the_concurrency_cap_get_429(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode = decode.mode = "hang"
    router = start_router([prefill.instance], [decode.instance], max_concurrent=2)
    held = [threading.Thread(target=_post_until_timeout, args=(router.url, 1.5)) for _ in range(2)]
    for t in held:
        t.start()
    wait_until(lambda: len(decode.received) == 2, "two requests at decode")
    reply = httpx.post(router.url + "/v1/completions", json=BODY, timeout=5)
    assert reply.status_code == 429 and reply.json()["error"] == {"message": ANY, "type": "busy", "code": 429}
    assert reply.headers["x-request-id"]
    for t in held:
        t.join()
    wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "both slots to be given back")
    prefill.mode = decode.mode = "ok"
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=5).status_code == 200
    assert router.metric("kvstage_router_requests_total", endpoint="/v1/completions", outcome="busy") == 1


def _post_until_timeout(url: str, timeout_s: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=BODY, timeout=timeout_s)


def test_bodies_over_the_limit_or_not_a_json_object_are_refused(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance], max_body_bytes=4096)
    reply = httpx.post(router.url + "/v1/completions", json={**BODY, "prompt": "x" * 5000}, timeout=5)
    assert reply.status_code == 413
    for junk in (b"[1]", b"{", b"[" * 3000):  # the last one nests deeper than the JSON decoder goes
        assert httpx.post(router.url + "/v1/completions", content=junk, timeout=5).status_code == 400
    assert not prefill.received and not decode.received
    assert router.metric("kvstage_router_requests_total", endpoint="/v1/completions", outcome="bad_request") == 4
    assert router.metric("kvstage_router_in_flight_requests") == 0


def test_instances_are_used_in_turn(upstreams, start_router) -> None:
    p0, p1, d0, d1 = (
        upstreams(n, r) for n, r in (("P0", "prefill"), ("P1", "prefill"), ("D0", "decode"), ("D1", "decode"))
    )
    router = start_router([p0.instance, p1.instance], [d0.instance, d1.instance])
    for _ in range(4):
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=5).status_code == 200
    assert [len(arrived(f, 2)) for f in (p0, p1, d0, d1)] == [2, 2, 2, 2]
    assert {r.body["kv_transfer_params"]["kvstage_peer"] for r in d1.received} == {"P1"}


def test_health_lists_each_instance_and_why_it_is_down(upstreams, start_router) -> None:
    prefill, d0 = upstreams("P0", "prefill"), upstreams("D0", "decode")
    dead = Instance("D1", "decode", closed_port_url())
    router = start_router([prefill.instance], [d0.instance, dead])
    reply = httpx.get(router.url + "/health", timeout=10)
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "degraded"
    state = {i["name"]: i for i in body["instances"]}
    assert state["P0"]["up"] and state["P0"]["tp_size"] == PREFILL_TP
    assert state["D0"]["up"] and state["D0"]["tp_size"] == DECODE_TP
    assert not state["D1"]["up"] and state["D1"]["reason"].startswith("connect")
    only_dead = start_router([prefill.instance], [dead])
    reply = httpx.get(only_dead.url + "/health", timeout=10)
    assert reply.status_code == 503 and reply.json()["status"] == "down"


def test_metrics_endpoint_exposes_outcomes_errors_and_latency(pair, start_router) -> None:
    prefill, decode = pair
    prefill.mode = "error500"
    router = start_router([prefill.instance], [decode.instance])
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=5).status_code == 200
    wait_until(lambda: router.metric("kvstage_router_in_flight_requests") == 0, "the request to end")
    text = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'kvstage_router_requests_total{endpoint="/v1/completions",outcome="ok"} 1.0' in text
    assert 'kvstage_router_upstream_errors_total{instance="P0",reason="http_5xx",role="prefill"} 1.0' in text
    assert 'kvstage_router_first_byte_seconds_count{endpoint="/v1/completions"} 1.0' in text
    assert 'kvstage_router_request_seconds_count{endpoint="/v1/completions"} 1.0' in text
    assert "kvstage_router_in_flight_requests 0.0" in text


def test_openai_client_through_the_router(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    assert [m.id for m in client.models.list()] == ["model-of-D0"]
    completion = client.completions.create(model="m", prompt="hello there", max_tokens=16)
    assert completion.choices[0].text == f"D0 answers room {decode.received[0].room}"
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "t0 t1 t2 "
    assert decode.received[1].body["stream"] is True and arrived(prefill, 2)[1].body["stream"] is False


def test_model_list_from_a_dead_decode_is_a_503(upstreams, start_router) -> None:
    router = start_router([upstreams("P0", "prefill").instance], [Instance("D0", "decode", closed_port_url())])
    reply = httpx.get(router.url + "/v1/models", timeout=10)
    assert reply.status_code == 503 and reply.json()["error"]["instance"] == "D0"


def test_a_tp_size_is_looked_up_again_and_kept_while_the_bootstrap_is_down(
    pair, start_router, bootstrap, caplog
) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance], tp_refresh_s=0.1, bootstrap_timeout_s=0.2)
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=5).status_code == 200
    client = BootstrapClient(bootstrap.address)
    for rank in range(2):  # D0 comes back with TP 2
        client.register(peer_record("D0", "decode", 2, rank, session=2))
    client.close()
    wait_until(lambda: router.router.tp.known(decode.instance) == 2, "the new TP size to be found")
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=5).status_code == 200
    bootstrap.close()
    wait_until(lambda: "keeping TP size 2" in caplog.text, "a refresh to fail")
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert [r.body["kv_transfer_params"]["kvstage_peer_tp"] for r in arrived(prefill, 3)] == [1, 2, 2]


def test_client_gone_while_sending_its_body_reaches_no_upstream(pair, start_router) -> None:
    prefill, decode = pair
    router = start_router([prefill.instance], [decode.instance])
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b'{"prompt": ')
    outcome = {"endpoint": "/v1/completions", "outcome": "client_disconnected"}
    wait_until(lambda: router.metric("kvstage_router_requests_total", **outcome) == 1, "the request to end")
    assert router.metric("kvstage_router_in_flight_requests") == 0
    assert not prefill.received and not decode.received


def test_with_the_secret_the_router_reads_a_secured_bootstrap_and_without_it_says_it_was_refused(
    pair, start_router
) -> None:
    prefill, decode = pair
    secret = b"router-tests-shared-secret"
    with BootstrapServer(secret=secret) as secured:
        register_instances(secured.address, secret)
        trusted = start_router([prefill.instance], [decode.instance], bootstrap=secured.address, secret=secret)
        assert httpx.post(trusted.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        assert decode.received[0].body["kv_transfer_params"]["kvstage_peer_tp"] == PREFILL_TP
        stranger = start_router([prefill.instance], [decode.instance], bootstrap=secured.address)
        reply = httpx.post(stranger.url + "/v1/completions", json=BODY, timeout=10)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["reason"] == "bootstrap" and "shared secret" in error["message"]
