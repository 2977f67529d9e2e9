"""The router's pure parts: instance specs, room ids and the two upstream bodies."""

from __future__ import annotations

import pytest

from kvstage.router.instances import Instance, RoundRobin, parse_instance
from kvstage.router.upstream import MAX_ROOM, decode_body, failure_from_response, new_room, prefill_body

P0 = Instance("P0", "prefill", "http://h:1")
D0 = Instance("D0", "decode", "http://h:2")


def test_instance_spec_is_name_equals_http_url() -> None:
    assert parse_instance("P0=http://10.0.0.2:8100/", "prefill") == Instance("P0", "prefill", "http://10.0.0.2:8100")
    for bad in ("P0", "=http://h:1", "P0=h:1", "P0=ftp://h:1", "P0=http://"):
        with pytest.raises(ValueError, match="NAME=http"):
            parse_instance(bad, "prefill")


def test_round_robin_hands_out_instances_in_turn() -> None:
    turn = RoundRobin([P0, D0])
    assert [turn.pick() for _ in range(3)] == [P0, D0, P0]
    with pytest.raises(ValueError):
        RoundRobin([])


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
