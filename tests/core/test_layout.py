"""Head mapping, staging plans, chunk grid and startup validation, proven over every valid configuration."""

from __future__ import annotations

import itertools

import pytest

from kvstage.errors import ConfigError, InvalidRequest
from kvstage.layout import (
    ChunkGrid,
    HeadTransfer,
    KVLayout,
    ceil_div,
    heads_of_rank,
    page_slice,
    pages_for,
    plan_head_transfers,
    plan_staging,
    replica_turn,
    validate_staging_config,
)

HEADS = (1, 2, 4, 8, 16)
TPS = (1, 2, 4, 8, 16, 32)


def _valid(num_heads: int, tp: int) -> bool:
    return num_heads % tp == 0 if tp <= num_heads else tp % num_heads == 0


VALID_CONFIGS = [(h, p, d) for h, p, d in itertools.product(HEADS, TPS, TPS) if _valid(h, p) and _valid(h, d)]


def test_every_head_tp_pair_of_the_matrix_is_valid() -> None:
    # With powers of two every pair is valid; the matrix covers fan-in, fan-out and replication both sides.
    assert len(VALID_CONFIGS) == len(HEADS) * len(TPS) ** 2


@pytest.mark.parametrize(("num_heads", "tp"), [(h, t) for h in HEADS for t in TPS])
def test_ranks_partition_heads_or_replicate_them_evenly(num_heads: int, tp: int) -> None:
    held = [heads_of_rank(num_heads, tp, rank) for rank in range(tp)]
    if tp <= num_heads:
        assert [h for r in held for h in r] == list(range(num_heads))
        assert {len(r) for r in held} == {num_heads // tp}
    else:
        assert all(len(r) == 1 for r in held)
        replication = tp // num_heads
        assert [r[0] for r in held] == [rank // replication for rank in range(tp)]


def test_fan_out_uses_integer_division_not_modulo() -> None:
    # H=2, P=1, D=4 must give source heads [0, 0, 1, 1] (upstream #23746 gave zero heads per rank).
    assert [heads_of_rank(2, 4, rank)[0] for rank in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("num_heads", "tp", "rank", "fragment"),
    [
        (8, 3, 0, "not divisible"),
        (4, 6, 0, "not a multiple"),
        (8, 4, 4, "outside"),
        (8, 4, -1, "outside"),
        (0, 1, 0, "num_kv_heads"),
        (8, 0, 0, "tp_size"),
    ],
)
def test_invalid_head_tp_combinations_say_why(num_heads: int, tp: int, rank: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        heads_of_rank(num_heads, tp, rank)


@pytest.mark.parametrize(("num_heads", "prefill_tp", "decode_tp"), VALID_CONFIGS)
def test_head_plan_writes_every_decode_head_exactly_once_from_a_holder(
    num_heads: int, prefill_tp: int, decode_tp: int
) -> None:
    plan = plan_head_transfers(num_heads, prefill_tp, decode_tp)
    written: dict[tuple[int, int], int] = {}
    load = [0] * prefill_tp
    for t in plan:
        src = heads_of_rank(num_heads, prefill_tp, t.prefill_rank)
        dst = heads_of_rank(num_heads, decode_tp, t.decode_rank)
        assert t.num_heads >= 1
        assert 0 <= t.src_head_start and t.src_head_start + t.num_heads <= len(src)
        assert 0 <= t.dst_head_start and t.dst_head_start + t.num_heads <= len(dst)
        for k in range(t.num_heads):
            head = dst[t.dst_head_start + k]
            assert src[t.src_head_start + k] == head, "the writer must hold the head it writes"
            key = (t.decode_rank, head)
            assert key not in written, f"head {head} of decode rank {t.decode_rank} written twice"
            written[key] = t.prefill_rank
        load[t.prefill_rank] += t.num_heads
    expected = {(d, h) for d in range(decode_tp) for h in heads_of_rank(num_heads, decode_tp, d)}
    assert set(written) == expected
    _assert_runs_are_maximal(plan)
    _assert_replicas_share_the_load(num_heads, prefill_tp, decode_tp, written)


def _assert_runs_are_maximal(plan: tuple[HeadTransfer, ...]) -> None:
    for a, b in itertools.pairwise(plan):
        mergeable = (
            a.decode_rank == b.decode_rank
            and a.prefill_rank == b.prefill_rank
            and a.src_head_start + a.num_heads == b.src_head_start
            and a.dst_head_start + a.num_heads == b.dst_head_start
        )
        assert not mergeable, f"{a} and {b} should have been merged"


def _assert_replicas_share_the_load(
    num_heads: int, prefill_tp: int, decode_tp: int, written: dict[tuple[int, int], int]
) -> None:
    if prefill_tp <= num_heads:
        return
    replication = prefill_tp // num_heads
    for head in range(num_heads):
        writers = [writer for (_, h), writer in sorted(written.items()) if h == head]
        counts = [writers.count(head * replication + k) for k in range(replication)]
        assert max(counts) - min(counts) <= 1, f"replicas of head {head} carry uneven load {counts}"


def test_worked_example_fan_in_h8_p4_d2() -> None:
    assert plan_head_transfers(8, 4, 2) == (
        HeadTransfer(0, 0, 0, 0, 2),
        HeadTransfer(1, 0, 0, 2, 2),
        HeadTransfer(2, 1, 0, 0, 2),
        HeadTransfer(3, 1, 0, 2, 2),
    )


def test_worked_example_fan_out_h2_p1_d4() -> None:
    assert plan_head_transfers(2, 1, 4) == (
        HeadTransfer(0, 0, 0, 0, 1),
        HeadTransfer(0, 1, 0, 0, 1),
        HeadTransfer(0, 2, 1, 0, 1),
        HeadTransfer(0, 3, 1, 0, 1),
    )


def test_replicated_writers_are_spread_round_robin() -> None:
    # H=2, P=4, D=4: head 0 lives on prefill ranks 0,1 and decode ranks 0,1 need it.
    assert [t.prefill_rank for t in plan_head_transfers(2, 4, 4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (4, 1), (4, 2), (8, 2), (1, 2)])
def test_rooms_spread_an_mla_latent_over_every_prefill_rank_by_their_turn(prefill_tp: int, decode_tp: int) -> None:
    writers: dict[int, int] = {}
    for room in range(1, 4 * prefill_tp + 1):
        plan = plan_head_transfers(1, prefill_tp, decode_tp, replica_turn(room, prefill_tp))
        assert [t.decode_rank for t in plan] == list(range(decode_tp))  # each decode rank: one writer, whole head
        for t in plan:
            writers[t.prefill_rank] = writers.get(t.prefill_rank, 0) + 1
    assert sorted(writers) == list(range(prefill_tp))  # every prefill rank writes some rooms
    assert len(set(writers.values())) == 1  # and all as many


@pytest.mark.parametrize("turn", range(8))
@pytest.mark.parametrize(("num_heads", "prefill_tp", "decode_tp"), [(2, 4, 1), (2, 8, 4), (4, 8, 16), (1, 8, 3)])
def test_every_turn_writes_each_decode_head_once_from_a_replica_that_holds_it(
    num_heads: int, prefill_tp: int, decode_tp: int, turn: int
) -> None:
    for d in range(decode_tp):
        plan = [t for t in plan_head_transfers(num_heads, prefill_tp, decode_tp, turn) if t.decode_rank == d]
        written = [heads_of_rank(num_heads, prefill_tp, t.prefill_rank)[t.src_head_start + i]
                   for t in plan for i in range(t.num_heads)]  # fmt: skip
        assert written == list(heads_of_rank(num_heads, decode_tp, d))


LAYOUT = KVLayout(num_layers=3, num_kv_heads=8, head_dim=4, dtype="bfloat16", page_size=16)


def test_layout_sizes_per_token_head_and_page() -> None:
    assert LAYOUT.itemsize == 2
    assert LAYOUT.head_bytes == 8
    assert LAYOUT.bytes_per_token() == 2 * 3 * 8 * 8
    assert LAYOUT.bytes_per_token(num_heads=2) == 2 * 3 * 2 * 8
    assert LAYOUT.bytes_per_head(num_tokens=5) == 2 * 3 * 5 * 8
    assert LAYOUT.bytes_per_page() == 16 * LAYOUT.bytes_per_token()


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 0), ("page_size", 0), ("dtype", "int4")],
)
def test_layout_rejects_invalid_fields_by_name(field: str, value: object) -> None:
    fields: dict[str, object] = {
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 1,
        "dtype": "float16",
        "page_size": 1,
    }
    fields[field] = value
    with pytest.raises(ConfigError, match=field if field != "dtype" else "dtype"):
        KVLayout(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_heads", "prefill_tp", "decode_tp"), VALID_CONFIGS)
def test_staging_plan_blocks_tile_the_region_in_writer_order(num_heads: int, prefill_tp: int, decode_tp: int) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=num_heads, head_dim=8, dtype="float16", page_size=4)
    for decode_rank in range(decode_tp):
        plan = plan_staging(layout, prefill_tp, decode_tp, decode_rank, num_tokens=7)
        offset = 0
        for block in plan.blocks:
            assert block.offset == offset
            assert block.layer_bytes == 7 * block.transfer.num_heads * layout.head_bytes
            assert block.nbytes == 2 * layout.num_layers * block.layer_bytes
            assert block.layer_offset(1, layout.num_layers - 1, layout.num_layers) + block.layer_bytes == (
                block.offset + block.nbytes
            )
            offset += block.nbytes
        assert plan.total_bytes == offset == 7 * layout.bytes_per_token(len(heads_of_rank(num_heads, decode_tp, 0)))
        assert list(plan.writers) == sorted(plan.writers)
        assert len(set(plan.writers)) == len(plan.writers), "one block per writer"


def test_staging_plan_names_a_writer_without_a_block() -> None:
    plan = plan_staging(LAYOUT, 4, 2, 0, num_tokens=16)
    assert plan.block_of(1).offset > 0
    with pytest.raises(InvalidRequest, match="writes nothing"):
        plan.block_of(3)


def test_chunk_grid_starts_at_the_prefix_and_the_last_chunk_may_be_short() -> None:
    grid = ChunkGrid(chunk_tokens=32, page_size=16)
    chunks = grid.chunks(num_tokens=100, prefix_tokens=16)
    assert [(c.index, c.start, c.end) for c in chunks] == [(0, 16, 48), (1, 48, 80), (2, 80, 100)]
    assert grid.num_chunks(100, 16) == 3
    assert grid.chunk(2, 100, 16).num_tokens == 20
    assert [grid.at(i, 100, 16) for i in range(3)] == list(chunks)  # the unchecked form the endpoints use


def test_prefix_hit_never_makes_a_chunk_longer_than_one_grid_slot() -> None:
    # Upstream #30545: a prefix-cache hit made the first send longer than one slot and overran allocations.
    grid = ChunkGrid(chunk_tokens=32, page_size=16)
    for prefix in range(0, 96, 16):
        for chunk in grid.chunks(num_tokens=130, prefix_tokens=prefix):
            assert 0 < chunk.num_tokens <= 32
            assert (chunk.start - prefix) == chunk.index * 32


@pytest.mark.parametrize(("num_tokens", "prefix"), [(100, 8), (100, -16), (16, 16), (10, 32)])
def test_chunk_grid_rejects_unaligned_prefix_and_empty_suffix(num_tokens: int, prefix: int) -> None:
    with pytest.raises(InvalidRequest):
        ChunkGrid(chunk_tokens=32, page_size=16).chunks(num_tokens, prefix)


def test_chunk_grid_serves_mla_and_rejects_only_a_chunk_size_off_the_page_grid() -> None:
    validate_staging_config(chunk_tokens=32, page_size=16)
    validate_staging_config(chunk_tokens=32, page_size=16, attention="mla")  # MLA stages too (an engine's own KV)
    assert ChunkGrid(chunk_tokens=32, page_size=16).num_chunks(100) == 4  # the direct path (and MLA) use it too
    with pytest.raises(ConfigError, match="positive multiple of page_size=16"):
        ChunkGrid(chunk_tokens=40, page_size=16)


def test_pages_of_a_chunk_are_the_pages_holding_its_tokens() -> None:
    grid = ChunkGrid(chunk_tokens=32, page_size=16)
    pages = tuple(range(100, 110))  # page i of the room holds tokens [16 i, 16 i + 16)
    assert [pages[grid.pages_of(c)] for c in grid.chunks(100, 16)] == [(101, 102), (103, 104), (105, 106)]
    assert pages[page_slice(17, 18, 16)] == (101,)
    assert [pages_for(n, 16) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]


def test_ceil_div_is_the_smallest_multiple_count_that_covers() -> None:
    for a, b in itertools.product(range(-20, 21), range(1, 6)):
        q = ceil_div(a, b)
        assert q * b >= a > (q - 1) * b, (a, b, q)


def test_chunk_index_outside_the_grid_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="outside"):
        ChunkGrid(chunk_tokens=32, page_size=16).chunk(4, num_tokens=100)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"chunk_tokens": None, "page_size": 16}, ("chunk_tokens", "page_size")),
        ({"chunk_tokens": 0, "page_size": 16}, ("chunk_tokens", "page_size")),
        ({"chunk_tokens": -32, "page_size": 16}, ("chunk_tokens", "page_size")),
        ({"chunk_tokens": 40, "page_size": 16}, ("chunk_tokens", "page_size")),
        ({"chunk_tokens": 32, "page_size": 16, "pp_size": 2}, ("pipeline parallelism",)),
        ({"chunk_tokens": 32, "page_size": 16, "context_parallel": True}, ("context parallelism",)),
        ({"chunk_tokens": 40, "page_size": 16, "attention": "mla"}, ("chunk_tokens", "page_size")),
        ({"chunk_tokens": 32, "page_size": 16, "attention": "linear"}, ("attention",)),
    ],
)
def test_staging_config_errors_name_the_setting_and_the_fix(
    kwargs: dict[str, object], fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate_staging_config(**kwargs)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(excinfo.value)


@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_staging_config_accepts_page_multiple_chunks(attention: str) -> None:
    validate_staging_config(chunk_tokens=64, page_size=16, attention=attention)
