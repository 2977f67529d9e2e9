"""Fault-free exchanges between real endpoints: every TP pairing and both paths complete and leave nothing behind."""

from __future__ import annotations

import pytest
from protocol_harness import (
    all_quiescent,
    attach,
    compute,
    decode_names,
    expect,
    full_room,
    make_pump,
    prefill_names,
)

from kvstage.layout import ChunkGrid, plan_staging
from kvstage.protocol import DecodeEndpoint, RoomSucceeded, Scatter, WriteDirect, WriteRegion


def written_blocks(pump, decode: str) -> set[tuple[int, int, int]]:
    """(room, chunk, prefill rank) of every staged write that targeted `decode`."""
    writers = {name: rank for rank, name in enumerate(prefill_names(pump))}
    return {(a.room, a.chunk, writers[src]) for src, a in pump.log if isinstance(a, WriteRegion) and a.peer == decode}


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp"),
    [(8, 4, 2), (8, 8, 1), (4, 2, 1)],
    ids=["H8-P4-D2", "H8-P8-D1", "H4-P2-D1"],
)
def test_fan_in_room_succeeds_with_every_writer_block_written_once(heads: int, prefill_tp: int, decode_tp: int) -> None:
    pump = make_pump(heads=heads, prefill_tp=prefill_tp, decode_tp=decode_tp)
    full_room(pump, 1, 45, prefix=4)
    assert all(pump.outcome(name, 1) == "ok" for name in pump.endpoints)
    chunks = -(-(45 - 4) // 8)
    for name in decode_names(pump):
        ep = pump.endpoints[name]
        assert isinstance(ep, DecodeEndpoint)
        writers = plan_staging(ep.config.layout, prefill_tp, decode_tp, ep.config.rank, 8).writers
        assert written_blocks(pump, name) == {(1, c, w) for c in range(chunks) for w in writers}
        assert len([a for a in pump.actions_of(name, Scatter)]) == chunks
    assert all_quiescent(pump)


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), [(8, 2, 4), (8, 1, 8), (4, 1, 2)])
def test_fan_out_room_succeeds_and_one_writer_feeds_several_decode_ranks(
    heads: int, prefill_tp: int, decode_tp: int
) -> None:
    pump = make_pump(heads=heads, prefill_tp=prefill_tp, decode_tp=decode_tp)
    full_room(pump, 2, 64)
    assert all(pump.outcome(name, 2) == "ok" for name in pump.endpoints)
    targets = {a.peer for src, a in pump.log if src == "p0" and isinstance(a, WriteRegion)}
    assert len(targets) == decode_tp // prefill_tp
    assert all_quiescent(pump)


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), [(2, 4, 1), (2, 8, 2), (2, 1, 4), (1, 2, 4), (2, 4, 8)])
def test_replicated_heads_room_succeeds(heads: int, prefill_tp: int, decode_tp: int) -> None:
    pump = make_pump(heads=heads, prefill_tp=prefill_tp, decode_tp=decode_tp)
    full_room(pump, 3, 30)
    assert all(pump.outcome(name, 3) == "ok" for name in pump.endpoints)
    assert all_quiescent(pump)


def test_prefill_rank_whose_heads_are_all_served_by_replicas_succeeds_at_once() -> None:
    pump = make_pump(heads=2, prefill_tp=4, decode_tp=1)  # head 0 by p0 (not p1), head 1 by p2 (not p3)
    expect(pump, 4, 16)
    attach(pump, 4, 16)
    assert pump.outcome("p1", 4) == "ok" and pump.outcome("p3", 4) == "ok"
    assert pump.outcome("p0", 4) is None
    compute(pump, 4, 16)
    pump.run()
    assert pump.outcome("d0", 4) == "ok"


@pytest.mark.parametrize(("heads", "tp", "attention"), [(8, 2, "gqa"), (4, 4, "mha"), (1, 2, "mla")])
def test_matched_tp_or_mla_room_takes_the_direct_path_without_ring_space(heads: int, tp: int, attention: str) -> None:
    pump = make_pump(heads=heads, prefill_tp=tp, decode_tp=tp, attention=attention)
    full_room(pump, 5, 40, prefix=8)
    assert all(pump.outcome(name, 5) == "ok" for name in pump.endpoints)
    assert not [a for _, a in pump.log if isinstance(a, WriteRegion | Scatter)]
    direct = [a for _, a in pump.log if isinstance(a, WriteDirect)]
    assert len(direct) == tp * 4  # 32 uncached tokens / 8 per chunk, per writer
    first = next(a for a in direct if a.chunk == 0)
    assert first.dst_pages == (5000 + 2, 5000 + 3)  # tokens 8..16 live in pages 2 and 3 (page size 4)
    assert all_quiescent(pump)


def test_mla_rooms_with_different_tp_go_direct_from_one_replica_each() -> None:
    pump = make_pump(heads=1, prefill_tp=2, decode_tp=4, attention="mla")
    full_room(pump, 6, 17)
    direct = [(src, a.peer) for src, a in pump.log if isinstance(a, WriteDirect) and a.chunk == 0]
    assert sorted(direct) == [("p0", "d0"), ("p0", "d2"), ("p1", "d1"), ("p1", "d3")]
    assert all(pump.outcome(name, 6) == "ok" for name in pump.endpoints)


def test_decode_rank_serves_rooms_from_two_prefill_instances_with_different_tp_at_once() -> None:
    pump = make_pump(heads=8, prefill_tp=4, decode_tp=2, prefill_instances=2)
    full_room(pump, 10, 50, instance=0)
    full_room(pump, 11, 33, instance=1)
    for room in (10, 11):
        assert pump.outcome("d0", room) == "ok" and pump.outcome("d1", room) == "ok"
    assert all_quiescent(pump)


def test_many_interleaved_rooms_all_succeed_and_the_ring_ends_empty() -> None:
    pump = make_pump(heads=8, prefill_tp=2, decode_tp=1, ring_bytes=4096 * 3)
    rooms = range(20, 40)
    for room in rooms:
        expect(pump, room, 8 * (room % 5 + 1))
        attach(pump, room, 8 * (room % 5 + 1))
    for room in rooms:
        compute(pump, room, 8 * (room % 5 + 1))
    pump.advance(5.0)
    assert [pump.outcome("d0", room) for room in rooms] == ["ok"] * len(rooms)
    assert len(pump.actions_of("d0", RoomSucceeded)) == len(rooms)
    assert all_quiescent(pump)


def test_scatter_and_write_carry_the_same_token_range_the_chunk_grid_gives() -> None:
    pump = make_pump(heads=8, prefill_tp=2, decode_tp=1, page_size=4, chunk_tokens=8)
    full_room(pump, 1, 27, prefix=4)  # chunks [4, 12) [12, 20) [20, 27): the last one short
    grid = ChunkGrid(chunk_tokens=8, page_size=4)
    expected = {c.index: (c.start, c.num_tokens) for c in grid.chunks(27, 4)}
    scatters = {a.chunk: (a.token_start, a.num_tokens) for _, a in pump.log if isinstance(a, Scatter)}
    writes = {(a.chunk, a.token_start, a.num_tokens) for _, a in pump.log if isinstance(a, WriteRegion)}
    assert scatters == expected
    assert writes == {(index, start, n) for index, (start, n) in expected.items()}
    assert all(a.num_tokens == a.plan.num_tokens for _, a in pump.log if isinstance(a, Scatter))


@pytest.mark.parametrize(
    ("decode_page", "prefill_page"), [(4, 16), (16, 4)], ids=["decode4-prefill16", "decode16-prefill4"]
)
@pytest.mark.parametrize("prefill_tp", [2, 1], ids=["staged", "direct"])
def test_a_room_between_different_page_sizes_reads_prefills_own_pages_on_decodes_chunk_grid(
    decode_page: int, prefill_page: int, prefill_tp: int
) -> None:
    pump = make_pump(
        heads=8,
        prefill_tp=prefill_tp,
        decode_tp=1,
        page_size=decode_page,
        prefill_page_size=prefill_page,
        chunk_tokens=16,
    )
    prefix, tokens = 16, 75  # decode's grid: chunks of 16 from token 16
    full_room(pump, 1, tokens, prefix=prefix)
    assert all(pump.outcome(name, 1) == "ok" for name in pump.endpoints)
    assert all_quiescent(pump)
    own_pages = tuple(50_000 + 1000 + i for i in range(-(-tokens // prefill_page)))  # harness's prefill pages
    decode_pages = tuple(1000 + i for i in range(-(-tokens // decode_page)))
    writes = [a for _, a in pump.log if isinstance(a, WriteRegion | WriteDirect)]
    assert {a.chunk for a in writes} == set(range(len(ChunkGrid(16, decode_page).chunks(tokens, prefix))))
    for a in writes:
        start = prefix + 16 * a.chunk
        assert a.src_offset == start % prefill_page
        assert a.src_pages == own_pages[start // prefill_page : -(-(start + a.num_tokens) // prefill_page)]
        if isinstance(a, WriteDirect):
            assert a.dst_pages == decode_pages[start // decode_page : -(-(start + a.num_tokens) // decode_page)]
