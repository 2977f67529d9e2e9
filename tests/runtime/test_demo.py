"""`kvstage demo --synthetic` runs the real agents end to end: rooms land bit-exact, the aborted one fails cleanly,
and the counts it prints are checked here against the plans independently of the demo's own bookkeeping."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvstage.demo.synthetic import ABORTED_BY_DECODE, DemoConfig, DemoReport, DemoRequest, print_report, run_demo
from kvstage.layout import ChunkGrid, KVLayout, plan_head_transfers, plan_staging
from kvstage.transport.data import TransportConfig

SMALL = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)


def _own_segments() -> set[str]:
    return {p.name for p in Path(TransportConfig().shm_dir).glob(f"kvstage-{os.getpid()}-*")}


@pytest.fixture(scope="module")
def default_report() -> DemoReport:
    before = _own_segments()
    report = run_demo()
    assert _own_segments() == before, "the demo left shared-memory segments behind"
    return report


def _planned_writes(config: DemoConfig) -> tuple[int, int]:
    """Staged bulk writes and bytes for every moved chunk (the aborted room: its computed tokens only)."""
    grid = ChunkGrid(config.chunk_tokens, config.layout.page_size)
    writes = nbytes = 0
    for request in config.requests:
        end = request.num_tokens if request.abort_after is None else request.abort_after
        for chunk in grid.chunks(end, request.prefix_tokens):
            for rank in range(config.decode_tp):
                plan = plan_staging(config.layout, config.prefill_tp, config.decode_tp, rank, chunk.num_tokens)
                writes += len(plan.blocks)
                nbytes += sum(block.nbytes for block in plan.blocks)
    return writes, nbytes


def test_demo_lands_every_room_bit_exact_and_aborts_one_with_its_pages_returned(default_report) -> None:
    report = default_report
    assert report.ok
    aborted = [r for r in report.rooms if r.request.abort_after is not None]
    landed = [r for r in report.rooms if r.request.abort_after is None]
    assert len(aborted) == 1 and len(landed) == len(report.config.requests) - 1
    assert all(r.ok and r.verified and not r.reasons for r in landed)
    assert any(r.request.prefix_tokens for r in landed), "one room starts from a decode-side cached prefix"
    (room,) = aborted
    # a decode rank may hear of decode's abort from a prefill rank before its own engine's call reaches it
    assert not room.ok and ABORTED_BY_DECODE in room.reasons and room.pages_back
    assert set(room.reasons) <= {ABORTED_BY_DECODE, "aborted by prefill"}, room.reasons
    assert report.expected_digest == report.decode_digest
    assert report.rings_empty and report.pages_returned
    assert report.rejected_frames == 0 and report.internal_errors == 0 and report.shm_left == ()


def test_demo_counts_equal_the_staging_plans_and_the_per_slice_formula(default_report) -> None:
    report, config = default_report, default_report.config
    writes, nbytes = _planned_writes(config)
    assert (report.staged_ops, report.bytes_moved) == (writes, nbytes)
    layout = config.layout
    runs = len(plan_head_transfers(layout.num_kv_heads, config.prefill_tp, config.decode_tp))
    pages = 0
    for r in config.requests:
        end = r.num_tokens if r.abort_after is None else r.abort_after
        pages += -(-end // layout.page_size) - r.prefix_tokens // layout.page_size
    assert report.direct_slices == 2 * layout.num_layers * pages * runs
    assert report.bytes_moved > report.config.decode_tp * report.ring_capacity  # the rings wrapped


def test_demo_with_more_decode_than_prefill_ranks_is_bit_exact_too() -> None:
    requests = (DemoRequest(37), DemoRequest(50, prefix_tokens=12), DemoRequest(40, abort_after=16))
    config = DemoConfig(layout=SMALL, prefill_tp=2, decode_tp=4, chunk_tokens=8, requests=requests, seed=3)
    report = run_demo(config)
    assert report.ok, report
    assert (report.staged_ops, report.bytes_moved) == _planned_writes(config)


def test_demo_reports_failure_when_rooms_do_not_land() -> None:
    # A decode ring smaller than one chunk: every room fails on decode at once ("staging oversized"), loudly; its
    # prefill ranks, which never got its metadata, give it up at its deadline.
    requests = (DemoRequest(24),)
    config = DemoConfig(
        layout=SMALL, prefill_tp=2, decode_tp=1, chunk_tokens=8, ring_chunks=0.5, requests=requests, timeout_s=3.0
    )
    report = run_demo(config)
    assert not report.ok
    (room,) = report.rooms
    assert not room.ok and not room.verified and room.reasons
    assert report.rings_empty and report.pages_returned and report.shm_left == ()
    out = io.StringIO()
    print_report(report, Console(file=out, width=200))
    assert "FAILED" in out.getvalue() and "OK: bit-exact" not in out.getvalue()


def test_kvstage_demo_synthetic_says_what_it_runs_and_exits_zero() -> None:
    script = "from kvstage.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", script, "demo", "--synthetic"], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first = " ".join(done.stdout.split())
    assert "end-to-end handoff through the real agents" in first
    assert "ZeroMQ and shared memory, in one process, with no model" in first
    assert "aborted by decode" in first
    assert "OK: bit-exact" in done.stdout
