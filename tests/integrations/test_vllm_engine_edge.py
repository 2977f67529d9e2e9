"""The engine edge: every sequence of calls vLLM can make ends correctly, and nothing a client sends hurts an engine.

Each test drives vLLM's own scheduler and kvstage's worker sides over real agents (`vllm_harness`): a prefill and
a decode engine, as the router would feed them. After every sequence: vLLM's scheduler never saw a finished id of
a request it does not hold (it asserts, as a real engine dies), every block is back in the pool exactly once, no
room went to two requests, and every decode request whose KV arrived holds exactly its prompt's KV.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_harness import Engine, Pair

from kvstage.e2e.model import TinyModelSpec, build_tiny_model
from kvstage.transport.bootstrap import BootstrapServer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TinyModelSpec(), tmp_path_factory.mktemp("model"))


@pytest.fixture
def bootstrap() -> Iterator[str]:
    server = BootstrapServer().start()
    yield server.address
    server.close()


@pytest.fixture
def make_pair(model: Path, bootstrap: str) -> Iterator[Callable[..., Pair]]:
    """A prefill (TP 2 unless told) and a decode engine (TP 1), closed after the test; `prefill` are more fields of
    the prefill engine, `decode_room_timeout_s` decode's room deadline (the harness's default unless given)."""
    made: list[Pair] = []

    def make(
        prefill_tp: int = 2,
        decode_tp: int = 1,
        async_scheduling: bool = False,
        decode_room_timeout_s: float | None = None,
        **prefill: Any,
    ) -> Pair:
        decode: dict[str, Any] = {} if decode_room_timeout_s is None else {"room_timeout_s": decode_room_timeout_s}
        pair = Pair(
            Engine("prefill", "P", prefill_tp, model, bootstrap, async_scheduling=async_scheduling, **prefill),
            Engine("decode", "D", decode_tp, model, bootstrap, async_scheduling=async_scheduling, **decode),
        )
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.prefill.close()
        pair.decode.close()


#: a prefill engine small enough that four concurrent 250-token prompts preempt each other (20 blocks of 16 tokens,
#: at most 32 tokens of one prompt per step)
PREEMPTING: dict[str, Any] = {"num_blocks": 20, "max_batched_tokens": 128, "chunk_cap": 32}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def assert_clean(pair: Pair) -> None:
    assert not pair.corrupt, f"decode requests got KV that is not their prompt's: {sorted(pair.corrupt)}"
    pair.prefill.assert_clean()
    pair.decode.assert_clean()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (1, 1)], ids=["2to1", "1to2", "1to1-direct"])
def test_requests_get_their_prompts_kv_and_every_block_is_freed_once(
    make_pair: Callable[..., Pair], prefill_tp: int, decode_tp: int
) -> None:
    pair = make_pair(prefill_tp, decode_tp)
    for i in range(3):
        pair.send(f"r{i}", prompt(i, 90 + 20 * i), room=100 + i)
    pair.run()
    assert pair.intact == {"r0", "r1", "r2"}
    assert_clean(pair)
    staged = prefill_tp != decode_tp  # matched TP writes decode's blocks directly: no ring byte
    assert all((w._agent.metrics.value("kvstage_ring_high_water_bytes") > 0) == staged for w in pair.decode.workers)


def test_a_prompt_prefilled_in_many_chunked_steps_arrives_whole(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(max_batched_tokens=32)
    pair.send("long", prompt(7, 300), room=7)
    pair.run()
    assert pair.intact == {"long"}
    assert_clean(pair)


@pytest.mark.parametrize("tp", [(2, 1), (1, 1)], ids=["2to1", "1to1-direct"])
def test_a_preempted_prefill_request_never_kills_the_engine_and_decode_recomputes_it(
    make_pair: Callable[..., Pair], tp: tuple[int, int]
) -> None:
    """At 5ef7c43 vLLM's scheduler asserted on a finished_sending id of a request the preemption had already let
    go (the engine core died). Direct writes too read prefill's blocks until their room ends."""
    pair = make_pair(*tp, **PREEMPTING)
    for i in range(4):
        pair.send(f"r{i}", prompt(20 + i, 250), room=20 + i)
    pair.run()
    assert pair.prefill.preemptions > 0, "the sequence must preempt on prefill"
    assert not pair.decode.live
    assert_clean(pair)


@pytest.mark.parametrize("preempt", [False, True], ids=["plain", "preempting"])
def test_with_async_scheduling_every_request_ends_and_every_block_is_freed_once(
    make_pair: Callable[..., Pair], preempt: bool
) -> None:
    """vLLM's async scheduling schedules step N+1 before it has seen step N's output: the connector's reports
    reach the scheduler a step late, and a preemption frees blocks that the step in flight still wrote."""
    pair = make_pair(async_scheduling=True, **(PREEMPTING if preempt else {}))
    for i in range(4):
        pair.send(f"r{i}", prompt(30 + i, 250 if preempt else 100), room=30 + i)
    pair.run()
    assert (pair.prefill.preemptions > 0) == preempt
    assert preempt or pair.intact == {"r0", "r1", "r2", "r3"}
    assert_clean(pair)


def test_a_request_preempted_and_aborted_in_the_same_step_is_reported_to_no_one(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(**PREEMPTING)
    for i in range(4):
        pair.send(f"r{i}", prompt(40 + i, 250), room=40 + i)
    deadline = time.monotonic() + 30
    while pair.prefill.preemptions == 0:
        assert time.monotonic() < deadline, "no preemption happened"
        pair.step()
    preempted = [r for r, req in pair.prefill.scheduler.requests.items() if req.num_preemptions > 0]
    for req_id in preempted:
        pair.prefill.abort(req_id)  # the client goes away right after the preemption, before the next step
    pair.run()
    assert_clean(pair)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_client_abort_on_either_side_ends_the_room_and_frees_every_block(
    make_pair: Callable[..., Pair], side: str
) -> None:
    pair = make_pair(max_batched_tokens=32)
    pair.send("gone", prompt(60, 200), room=60)
    pair.send("stays", prompt(61, 100), room=61)
    for _ in range(3):
        pair.step()
    (pair.prefill if side == "prefill" else pair.decode).abort("gone")
    pair.run()
    assert "stays" in pair.intact
    assert "gone" not in pair.intact
    assert_clean(pair)


def test_n_children_sharing_one_routers_room_each_get_a_room_and_their_kv(make_pair: Callable[..., Pair]) -> None:
    """vLLM gives every child of an n>1 request the same kv_transfer_params; at 5ef7c43 the children shared one
    room and one of them waited for its KV forever."""
    pair = make_pair()
    same = prompt(70, 120)
    for child in ("0_req", "1_req"):
        pair.send(child, same, room=70)
    pair.run()
    assert pair.intact == {"0_req", "1_req"}
    assert len(pair.decode.rooms) == 2
    assert_clean(pair)


def test_an_n_child_that_arrives_after_its_sibling_finished_on_prefill_gets_a_room_of_its_own(
    make_pair: Callable[..., Pair],
) -> None:
    """vLLM adds an n>1 request's children one at a time, and prefill (one token) may finish the first before the
    second arrives. At 4975b2d the second then got the first's room: prefill refused it as already attached and
    held the first's blocks for good, decode waited out the room deadline for the second (seen end to end: n=2
    through the router took 30 s, and P2 kept 2 blocks for the rest of the session)."""
    pair = make_pair()
    same = prompt(75, 120)
    pair.prefill.add("0_req", same, pair.params(75, pair.prefill), max_tokens=1)
    pair.decode.add("0_req", same, pair.params(75, pair.decode), max_tokens=3)
    for _ in range(1000):
        if "0_req" in pair.prefill.answers:
            break
        pair.step()
    assert "0_req" in pair.prefill.answers, "prefill did not finish the first child"
    pair.send("1_req", same, room=75)
    pair.run()
    assert pair.intact == {"0_req", "1_req"}
    assert len(pair.prefill.rooms) == len(pair.decode.rooms) == 2
    assert_clean(pair)


def test_a_list_of_prompts_sharing_one_routers_room_each_get_their_own_kv(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    for i in range(2):
        pair.send(f"req-{i}", prompt(80 + i, 100), room=80)
    pair.run()
    assert pair.intact == {"req-0", "req-1"}
    assert_clean(pair)


#: kvstage params a client can send straight to vLLM, each unusable in its own way
MALFORMED: dict[str, dict[str, object]] = {
    "room-str": {"kvstage_room": "abc"},
    "no-peer": {"kvstage_room": 5},
    "negative": {"kvstage_room": -1, "kvstage_peer": "P", "kvstage_peer_tp": 0},
    "huge-tp": {"kvstage_room": 5, "kvstage_peer": "P", "kvstage_peer_tp": 10**9},
    "huge-room": {"kvstage_room": 2**80, "kvstage_peer": "P", "kvstage_peer_tp": 1},
    "bool-room": {"kvstage_room": True, "kvstage_peer": "P", "kvstage_peer_tp": 1},
    "list-peer": {"kvstage_room": 5, "kvstage_peer": ["P"], "kvstage_peer_tp": 1},
    "long-peer": {"kvstage_room": 5, "kvstage_peer": "x" * 5000, "kvstage_peer_tp": 1},
}


def test_malformed_kvstage_params_are_refused_counted_and_the_request_runs_without_kvstage(
    make_pair: Callable[..., Pair],
) -> None:
    """At 5ef7c43 RoomParams raised inside vLLM's schedule() (one request killed the engine), or took a bool for a
    room, a list for a peer name, a billion for a TP size (a worker built a billion peer ids)."""
    pair = make_pair(prefill_tp=1)
    for name, params in MALFORMED.items():
        pair.decode.add(name, prompt(90, 40), params, max_tokens=2)
    pair.run()
    assert pair.decode.scheduler.connector.refused["bad params"] == len(MALFORMED)
    assert not pair.decode.rooms
    assert_clean(pair)


def test_a_request_prefill_gives_up_before_attaching_fails_decodes_room_within_seconds(
    make_pair: Callable[..., Pair],
) -> None:
    pair = make_pair()
    pair.decode.add("r", prompt(95, 100), pair.params(95, pair.decode))
    pair.prefill.add("r", prompt(95, 100), pair.params(95, pair.prefill), max_tokens=1)
    pair.decode.step()  # decode registers the room; prefill has not scheduled its request yet
    pair.prefill.abort("r")  # e.g. the router cancelled it, or its client went away while it was queued
    started = time.monotonic()
    pair.run(until=[pair.decode])
    assert time.monotonic() - started < 2.0, "decode's room waited for its deadline"
    assert "r" not in pair.intact
    assert_clean(pair)


def test_a_room_paired_with_another_prompt_fails_instead_of_landing(make_pair: Callable[..., Pair]) -> None:
    """Both rooms end at their deadline (prefill's blocks are held until then): 3 s here, not the harness's 20 s."""
    pair = make_pair(room_timeout_s=3.0, decode_room_timeout_s=3.0)
    pair.decode.add("r", prompt(96, 100), pair.params(96, pair.decode))
    pair.prefill.add("r", prompt(97, 100), pair.params(96, pair.prefill), max_tokens=1)  # a misrouted room
    pair.run()
    assert not pair.intact and not pair.corrupt  # decode recomputed the prompt itself
    assert_clean(pair)


# ---- vLLM's sequential flow: prefill first, its answer's kv_transfer_params handed to decode -----------------------


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 1)], ids=["2to1", "1to2", "4to1-replicated-heads"]
)
def test_in_the_sequential_flow_decode_gets_the_prompts_kv_from_the_blocks_prefill_held_for_it(
    make_pair: Callable[..., Pair], prefill_tp: int, decode_tp: int
) -> None:
    pair = make_pair(prefill_tp, decode_tp)
    for i in range(2):
        pair.send_sequential(f"s{i}", prompt(200 + i, 100 + 30 * i))
        answer = pair.prefill.answers[f"s{i}"]
        assert answer is not None and answer["do_remote_prefill"] is True
        assert (answer["kvstage_peer"], answer["kvstage_peer_tp"]) == ("P", prefill_tp)
        assert f"s{i}" in pair.prefill.live, "prefill freed the blocks before decode took the KV"
    pair.run(timeout_s=10.0)  # every prefill rank ends its room well before the 20 s deadline, idle ranks too
    assert pair.intact == {"s0", "s1"}
    assert_clean(pair)


def test_in_the_sequential_flow_prefill_frees_the_blocks_at_the_deadline_when_decode_does_not_come_in_time(
    make_pair: Callable[..., Pair],
) -> None:
    pair = make_pair(room_timeout_s=3.0)
    pair.send_sequential("lost", prompt(210, 120), to_decode=False)  # the proxy lost prefill's answer
    assert "lost" in pair.prefill.live  # held for decode, whose ranks would attach within the deadline
    pair.run(until=[pair.prefill], timeout_s=30.0)  # the room fails at its deadline; vLLM frees the blocks
    for worker in pair.prefill.workers:
        agent = worker._agent
        assert agent is not None and agent.metrics.value("kvstage_room_failures_total", reason="timeout") == 1
    pair.prefill.assert_clean()
    # the answer reaches decode after all: prefill aborts the room it remembers, and decode computes the prompt
    pair.decode.add("lost", prompt(210, 120), pair.prefill.answers["lost"], max_tokens=3)
    pair.run(timeout_s=10.0)  # well before decode's own room deadline (20 s)
    assert "lost" not in pair.intact
    assert_clean(pair)


#: kv_transfer_params of vLLM's sequential flow that a client can get wrong, and the instance they are sent to
BAD_SEQUENTIAL: dict[str, tuple[str, dict[str, object]]] = {
    "flag-str": ("prefill", {"do_remote_decode": "yes"}),
    "both-flows": ("prefill", {"do_remote_decode": True, "kvstage_room": 5, "kvstage_peer": "D", "kvstage_peer_tp": 1}),
    "both-flags": ("prefill", {"do_remote_decode": True, "do_remote_prefill": True}),
    "router-room-zero": ("prefill", {"do_remote_decode": True, "kvstage_room": 0}),  # sglang-router's, turned
    "answer-to-prefill": (
        "prefill",
        {"do_remote_prefill": True, "kvstage_room": 5, "kvstage_peer": "P", "kvstage_peer_tp": 2},
    ),
    "decode-asked-to-prefill": ("decode", {"do_remote_decode": True}),
    "other-connector": ("decode", {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1]}),
    "answer-tampered": (
        "decode",
        {"do_remote_prefill": True, "kvstage_room": 5, "kvstage_peer": "P", "kvstage_peer_tp": "2"},
    ),
}


def test_bad_sequential_flow_params_are_refused_counted_and_the_request_runs_without_kvstage(
    make_pair: Callable[..., Pair],
) -> None:
    pair = make_pair()
    for name, (role, params) in BAD_SEQUENTIAL.items():
        engine = pair.prefill if role == "prefill" else pair.decode
        engine.add(name, prompt(220, 40), params, max_tokens=1 if role == "prefill" else 2)
    pair.run()
    for engine in (pair.prefill, pair.decode):
        refused = sum(role == engine.role for role, _ in BAD_SEQUENTIAL.values())
        assert engine.scheduler.connector.refused["bad params"] == refused
        assert not engine.rooms
    assert not any(pair.prefill.answers.values()), "prefill answered kv_transfer_params for a refused request"
    assert_clean(pair)
