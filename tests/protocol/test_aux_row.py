"""The aux row (issue 34): an engine's opaque bytes given with the KVReady that completes a room ride the ChunkReady
of the room's last chunk, and decode reports them with the room's success (protocol/aux.py)."""

from __future__ import annotations

import msgspec
import pytest
from protocol_harness import (
    Pump,
    attach,
    decode,
    decode_names,
    expect,
    inject,
    make_pump,
    prefill_names,
    sends_from,
)

from kvstage.errors import ConfigError, InvalidRequest
from kvstage.layout import pages_for
from kvstage.protocol import (
    Codec,
    ComputeScheduled,
    DecodeConfig,
    DecodeEndpoint,
    KVReady,
    Limits,
    RoomSucceeded,
)
from kvstage.protocol.aux import CONFLICT, NOT_LAST_CHUNK, OVER_BOUND, largest_ready_frame
from kvstage.protocol.messages import MAX_AUX_BYTES, ChunkReady, Envelope

ROW = b"first token 42, logprob -0.5, room 7"
TOKENS = 24  # three chunks of 8 tokens


def ready(pump: Pump, name: str, room: int, end: int, aux: bytes = b"") -> None:
    page_size = pump.endpoints[name].config.layout.page_size
    pages = tuple(50_000 + room * 1000 + i for i in range(pages_for(end, page_size)))
    pump.call(name, ComputeScheduled(room, end))
    pump.call(name, KVReady(room, end, pages, aux))


def run_room(pump: Pump, room: int, rows: dict[str, bytes] | None = None) -> None:
    """Decode expects `room`, every prefill rank computes it in two steps; the completing one gives `rows[rank]`
    (default: ROW on every rank)."""
    expect(pump, room, TOKENS)
    attach(pump, room, TOKENS)
    for name in prefill_names(pump):
        ready(pump, name, room, 8)
    for name in prefill_names(pump):
        ready(pump, name, room, TOKENS, ROW if rows is None else rows[name])
    pump.run()


def succeeded_aux(pump: Pump, name: str, room: int) -> bytes:
    ends = [a for a in pump.actions_of(name, RoomSucceeded) if isinstance(a, RoomSucceeded) and a.room == room]
    assert len(ends) == 1, f"room {room} did not succeed once on {name}: {pump.outcome(name, room)}"
    return ends[0].aux


def ready_notices(pump: Pump, name: str) -> list[ChunkReady]:
    return [b for b in sends_from(pump, name, ChunkReady) if isinstance(b, ChunkReady)]


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp"),
    [(8, 2, 1), (8, 1, 2), (8, 2, 2), (8, 4, 2), (2, 4, 1)],
    ids=["2->1", "1->2", "2->2 direct", "4->2", "4->1 replicated heads"],
)
def test_an_aux_row_given_with_the_completing_kv_ready_reaches_every_decode_rank_with_its_success(
    heads: int, prefill_tp: int, decode_tp: int
) -> None:
    pump = make_pump(heads=heads, prefill_tp=prefill_tp, decode_tp=decode_tp)
    run_room(pump, 7)
    for name in decode_names(pump):
        assert succeeded_aux(pump, name, 7) == ROW
    for name in prefill_names(pump):
        assert pump.outcome(name, 7) == "ok"
        for notice in ready_notices(pump, name):  # only the last chunk's ChunkReady carries it
            assert notice.aux == (ROW if notice.chunk == 2 else b"")


def test_a_room_completed_without_an_aux_row_succeeds_with_an_empty_one() -> None:
    pump = make_pump(prefill_tp=2, decode_tp=1)
    run_room(pump, 7, {"p0": b"", "p1": b""})
    assert succeeded_aux(pump, "d0", 7) == b""


def test_a_writer_without_an_aux_row_leaves_the_row_of_the_other_writer() -> None:
    pump = make_pump(prefill_tp=2, decode_tp=1)
    run_room(pump, 7, {"p0": b"", "p1": ROW})
    assert succeeded_aux(pump, "d0", 7) == ROW


def test_an_aux_row_on_a_kv_ready_that_does_not_complete_the_room_is_refused_as_an_invalid_engine_call() -> None:
    pump = make_pump(prefill_tp=1, decode_tp=1)
    expect(pump, 7, TOKENS)
    attach(pump, 7, TOKENS)
    with pytest.raises(InvalidRequest, match="only the KVReady that completes the room"):
        ready(pump, "p0", 7, 8, ROW)
    ready(pump, "p0", 7, TOKENS, b"the completing one")  # the refused call changed nothing
    pump.run()
    assert succeeded_aux(pump, "d0", 7) == b"the completing one"


def test_an_aux_row_over_the_bound_is_refused_as_an_invalid_engine_call() -> None:
    pump = make_pump(prefill_tp=1, decode_tp=1, limits=Limits(max_aux_bytes=16))
    expect(pump, 7, TOKENS)
    attach(pump, 7, TOKENS)
    with pytest.raises(InvalidRequest, match=r"exceeds Limits\.max_aux_bytes=16"):
        ready(pump, "p0", 7, TOKENS, bytes(17))
    ready(pump, "p0", 7, TOKENS, bytes(16))
    pump.run()
    assert succeeded_aux(pump, "d0", 7) == bytes(16)


def test_a_second_completing_kv_ready_may_not_change_the_aux_row() -> None:
    pump = make_pump(prefill_tp=1, decode_tp=1)
    expect(pump, 7, TOKENS)
    attach(pump, 7, TOKENS)
    ready(pump, "p0", 7, TOKENS, ROW)
    with pytest.raises(InvalidRequest, match="this one differs"):
        ready(pump, "p0", 7, TOKENS, b"another row")
    ready(pump, "p0", 7, TOKENS, ROW)  # the same row again, or none, is fine
    ready(pump, "p0", 7, TOKENS)
    pump.run()
    assert succeeded_aux(pump, "d0", 7) == ROW


def test_an_aux_bound_that_leaves_no_room_in_a_control_frame_is_refused_at_configuration() -> None:
    limits = Limits(max_aux_bytes=4096)
    config = DecodeConfig("d0", make_pump().endpoints["d0"].config.layout, 1, 0, 8, 1 << 20, limits=limits)
    with pytest.raises(ConfigError, match="does not fit a control frame"):
        DecodeEndpoint(config, session=1, codec=Codec(max_frame_bytes=4096))
    DecodeEndpoint(config, session=1, codec=Codec(max_frame_bytes=largest_ready_frame(4096)))
    with pytest.raises(ConfigError, match="exceeds the wire's bound"):
        Limits(max_aux_bytes=MAX_AUX_BYTES + 1)


def test_an_agent_whose_control_frames_cannot_carry_the_aux_row_is_refused_at_configuration() -> None:
    from kvstage.runtime import AgentConfig
    from kvstage.transport.control import ChannelConfig

    layout = make_pump().endpoints["d0"].config.layout
    fields = {"instance": "D", "rank": 0, "tp_size": 1, "layout": layout, "bootstrap": "tcp://127.0.0.1:1"}
    with pytest.raises(ConfigError, match="does not fit a control frame"):
        AgentConfig(**fields, channel=ChannelConfig(max_frame_bytes=128 * 2**10))  # type: ignore[arg-type]
    AgentConfig(**fields, channel=ChannelConfig(max_frame_bytes=1 << 20))  # type: ignore[arg-type]


def forged_last_notice(pump: Pump, room: int) -> tuple[list[ChunkReady], Pump]:
    """Run `room` (2 -> 1) with every ChunkReady of p1 lost, so d0 holds each chunk granted and waiting for p1;
    returns p1's ChunkReady notices (to be forged and injected by the test)."""
    lost: list[ChunkReady] = []

    def drop(src: str, dst: str, envelope: Envelope) -> bool:
        if src == "p1" and isinstance(envelope.body, ChunkReady):
            lost.append(envelope.body)
            return True
        return False

    pump.drop = drop
    run_room(pump, room)
    assert pump.outcome("d0", room) is None
    return lost, pump


@pytest.mark.parametrize(
    ("chunk", "aux", "label"),
    [(0, ROW, NOT_LAST_CHUNK), (2, bytes(65), OVER_BOUND), (2, b"not the row p0 sent", CONFLICT)],
    ids=["on a chunk that is not the last", "over the bound", "unlike the other writer's"],
)
def test_an_aux_row_from_the_wire_that_breaks_the_rules_fails_the_room(chunk: int, aux: bytes, label: str) -> None:
    """an aux row on a chunk that is not the room's last, over the bound, or unlike the one the room's other writer
    sent fails the room on decode as a protocol violation"""
    lost, pump = forged_last_notice(make_pump(prefill_tp=2, decode_tp=1, limits=Limits(max_aux_bytes=64)), 7)
    notice = next(n for n in lost if n.chunk == chunk)
    inject(pump, "d0", "p1", msgspec.structs.replace(notice, aux=aux))
    pump.run()
    assert pump.outcome("d0", 7) == "protocol violation"
    assert decode(pump).stats.messages_rejected[label] == 1
    assert pump.outcome("p1", 7) == "aborted by decode"  # the writer still waiting for its acks learns it


def test_the_same_aux_row_from_both_writers_and_again_in_a_duplicate_is_accepted() -> None:
    lost, pump = forged_last_notice(make_pump(prefill_tp=2, decode_tp=1), 7)
    last = next(n for n in lost if n.chunk == 2)
    assert last.aux == ROW
    for notice in [*lost, last]:  # p1's notices delivered late, the last one twice
        inject(pump, "d0", "p1", notice)
    pump.run()
    assert succeeded_aux(pump, "d0", 7) == ROW
    assert decode(pump).stats.duplicates >= 1


def test_two_writers_giving_different_aux_rows_fail_the_room() -> None:
    pump = make_pump(prefill_tp=2, decode_tp=1)
    run_room(pump, 7, {"p0": b"row of p0", "p1": b"row of p1"})
    assert pump.outcome("d0", 7) == "protocol violation"
    assert decode(pump).stats.messages_rejected[CONFLICT] == 1


def test_a_retransmitted_last_chunk_ready_carries_the_same_aux_row() -> None:
    pump = make_pump(prefill_tp=1, decode_tp=1)
    first: list[int] = []

    def drop(src: str, dst: str, envelope: Envelope) -> bool:  # the last chunk's first two notices are lost
        if isinstance(envelope.body, ChunkReady) and envelope.body.chunk == 2 and len(first) < 2:
            first.append(2)
            return True
        return False

    pump.drop = drop
    run_room(pump, 7)
    pump.advance(5.0)
    last = [n for n in ready_notices(pump, "p0") if n.chunk == 2]
    assert len(last) >= 3 and all(n.aux == ROW for n in last)
    assert succeeded_aux(pump, "d0", 7) == ROW
