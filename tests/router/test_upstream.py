"""The router's pure parts: instance specs, room ids, the two upstream bodies and their headers."""

from __future__ import annotations

import pytest

from kvstage.router.instances import Instance, parse_instance
from kvstage.router.upstream import (
    MAX_ROOM,
    decode_body,
    decode_only_reason,
    failure_from_response,
    new_room,
    prefill_body,
    upstream_headers,
)

P0 = Instance("P0", "prefill", "http://h:1")
D0 = Instance("D0", "decode", "http://h:2")


def test_instance_spec_is_name_equals_http_url() -> None:
    assert parse_instance("P0=http://10.0.0.2:8100/", "prefill") == Instance("P0", "prefill", "http://10.0.0.2:8100")
    for bad in ("P0", "=http://h:1", "P0=h:1", "P0=ftp://h:1", "P0=http://"):
        with pytest.raises(ValueError, match="NAME=http"):
            parse_instance(bad, "prefill")


def test_rooms_are_in_range_and_differ() -> None:
    rooms = {new_room() for _ in range(1000)}
    assert len(rooms) == 1000 and all(1 <= r < MAX_ROOM for r in rooms)


def test_bodies_are_copies_and_the_clients_own_params_never_pass() -> None:
    body = {"prompt": "x", "max_tokens": 9, "stream": True, "kv_transfer_params": {"kvstage_room": 1}}
    before = {**body}
    to_prefill = prefill_body(body, chat=False, room=5, decode=D0, decode_tp=2)
    to_decode = decode_body(body, room=5, prefill=P0, prefill_tp=4)
    assert body == before
    assert to_prefill["kv_transfer_params"] == {"kvstage_room": 5, "kvstage_peer": "D0", "kvstage_peer_tp": 2}
    assert "max_completion_tokens" not in to_prefill  # only chat has it
    assert to_decode["kv_transfer_params"] == {"kvstage_room": 5, "kvstage_peer": "P0", "kvstage_peer_tp": 4}
    assert "kv_transfer_params" not in decode_body(body, room=None, prefill=None, prefill_tp=0)


def test_upstream_error_replies_keep_their_message() -> None:
    openai_style = failure_from_response(D0, 500, b'{"error": {"message": "engine dead"}}')
    assert (openai_style.status, openai_style.reason) == (502, "http_5xx") and "engine dead" in str(openai_style)
    refused = failure_from_response(D0, 400, b'{"message": "bad model"}')
    assert (refused.status, refused.reason) == (400, "http_4xx") and "bad model" in str(refused)
    assert "not json" in failure_from_response(D0, 503, b"not json").detail


def test_kvstage_keys_a_client_hides_in_vllm_xargs_or_anywhere_else_never_pass() -> None:
    xargs = {"kvstage_room": 1, "KVSTAGE_PEER": "evil", "kv_transfer_params": {"kvstage_room": 2}, "keep": 3}
    body = {"prompt": "x", "kvstage_room": 4, "kv_transfer_params": {"kvstage_room": 5}, "vllm_xargs": xargs}
    before = {**body, "vllm_xargs": {**xargs}}
    to_prefill = prefill_body(body, chat=False, room=6, decode=D0, decode_tp=1)
    to_decode = decode_body(body, room=6, prefill=P0, prefill_tp=2)
    alone = decode_body(body, room=None, prefill=None, prefill_tp=0)
    assert body == before
    for out in (to_prefill, to_decode, alone):
        assert out["vllm_xargs"] == {"keep": 3} and "kvstage_room" not in out
    assert to_prefill["kv_transfer_params"]["kvstage_room"] == to_decode["kv_transfer_params"]["kvstage_room"] == 6
    assert "kv_transfer_params" not in alone


def test_n_and_a_list_of_prompts_reach_prefill_unchanged() -> None:
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 9}
    to_prefill = prefill_body(body, chat=False, room=5, decode=D0, decode_tp=1)
    assert to_prefill["n"] == 2 and to_prefill["prompt"] == ["a", "b"] and to_prefill["max_tokens"] == 1


def test_beam_search_as_pydantic_reads_a_bool_is_served_by_decode_alone() -> None:
    for on in (True, 1, "true", "On"):
        assert decode_only_reason({"use_beam_search": on}) == "beam_search"
    for off in (False, 0, "false", None):
        assert decode_only_reason({"use_beam_search": off}) is None
    assert decode_only_reason({"n": 4}) is None


def test_upstream_headers_carry_the_request_id_and_only_the_upstream_key() -> None:
    assert upstream_headers("r1", None) == {"accept-encoding": "identity", "x-request-id": "r1"}
    assert upstream_headers("r1", "k")["authorization"] == "Bearer k"
