"""The in-process demo moves real bytes through real rings, verifies them, and reports honest counts."""

from __future__ import annotations

from typer.testing import CliRunner

from kvstage.cli import app
from kvstage.demo import DemoConfig, DemoRequest, run_demo
from kvstage.layout import ChunkGrid, KVLayout, plan_head_transfers, plan_staging


def test_demo_round_trip_is_bit_exact_and_counts_match_the_plans() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float8_e4m3fn", page_size=4)
    requests = (DemoRequest(37), DemoRequest(50, prefix_tokens=12), DemoRequest(8))
    config = DemoConfig(layout=layout, prefill_tp=1, decode_tp=4, chunk_tokens=8, requests=requests, seed=3)
    report = run_demo(config)
    assert report.ok and report.rings_empty and report.pages_returned
    grid = ChunkGrid(8, 4)
    chunks = [c for r in requests for c in grid.chunks(r.num_tokens, r.prefix_tokens)]
    assert report.chunks == len(chunks)
    plans = [plan_staging(layout, 1, 4, rank, c.num_tokens) for c in chunks for rank in range(4)]
    assert report.staged_ops == sum(len(p.blocks) for p in plans)
    assert report.bytes_moved == sum(p.total_bytes for p in plans)
    runs = len(plan_head_transfers(2, 1, 4))
    pages = sum(-(-r.num_tokens // 4) - r.prefix_tokens // 4 for r in requests)
    assert report.direct_ops == 2 * 2 * pages * runs
    assert report.max_round >= 1  # the ring was reused


def test_kvstage_demo_command_says_it_is_an_in_process_round_trip_and_succeeds() -> None:
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    assert "in-process" in result.output
    assert "OK: bit-exact" in result.output
