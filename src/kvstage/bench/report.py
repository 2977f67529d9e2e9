"""How `kvstage bench` shows itself: a progress display while running, a table, a JSON line and a bar chart.

Owns presentation only: `run_with_progress` (rich progress on stderr, so stdout stays parseable), `print_table`,
`json_line` (the `--json` object, one line, always the last line of stdout) and `plot` (matplotlib, imported
only when `--plot` is given); and the same for `--handoff` (bench/handoff.py): `run_handoff_with_progress`,
`print_handoff_table`, `handoff_json_line`. Called by the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstage.bench.config import BenchConfig
from kvstage.bench.handoff import HandoffConfig, HandoffResult, run_handoff
from kvstage.bench.handoff import total_steps as handoff_steps
from kvstage.bench.runner import BenchResult, run_bench, total_steps
from kvstage.bench.stages import LANE_SEGMENTS, SCATTER_SEGMENTS

SEGMENT_ORDER = (*(name for name, _, _ in LANE_SEGMENTS + SCATTER_SEGMENTS), "latency", "period")
T = TypeVar("T")
LABELS = {"staged": "staged (agents)", "slice": "direct per-slice", "raw": "raw bulk"}


def label(result: BenchResult, path: str) -> str:
    """A path's name in the table and the plot: the agents' path is direct where the TP sizes match."""
    if path == "staged" and result.config.prefill_tp == result.config.decode_tp:
        return "direct (agents)"
    return LABELS[path]


def run_with_progress(config: BenchConfig) -> BenchResult:
    """`run_bench` with a live progress bar on stderr (silent when stderr is not a terminal)."""
    return _with_progress(lambda step: run_bench(config, step), total_steps(config))


def run_handoff_with_progress(config: HandoffConfig) -> HandoffResult:
    """`run_handoff` with a live progress bar on stderr (silent when stderr is not a terminal)."""
    return _with_progress(lambda step: run_handoff(config, step), handoff_steps(config))


def _with_progress(run: Callable[[Callable[[str], None]], T], total: int) -> T:
    with Progress(
        TextColumn("[bold]kvstage bench[/]"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=total)
        first = True

        def step(description: str) -> None:
            nonlocal first
            progress.update(task, description=description, advance=0 if first else 1)
            first = False

        result = run(step)
        progress.update(task, completed=total)
    return result


def print_table(result: BenchResult, console: Console) -> None:
    c = result.config
    title = (
        f"{c.backend}: {c.model}, prefill TP {c.prefill_tp} -> decode TP {c.decode_tp}, {c.tokens} tokens, "
        f"page {c.page_size}, chunk {c.chunk_tokens}, {c.concurrency} concurrent, best of {c.repeats}"
    )
    table = Table(title=title)
    for name in ("path", "GB/s (best)", "GB/s (median)", "ops/request", "MiB/request"):
        table.add_column(name, justify="left" if name == "path" else "right")
    for path in result.paths:
        table.add_row(
            label(result, path.name),
            f"{path.best_gbps:.3f}",
            f"{path.median_gbps:.3f}",
            f"{path.ops_per_request:,.0f}",
            f"{c.moved_bytes / 2**20:,.1f}",
        )
    console.print(table)
    if result.gpus == 1:
        console.print(
            f"every rank ({c.prefill_tp} prefill + {c.decode_tp} decode) shares one GPU: the staged path's gathers, "
            "writes and scatters and the baselines' writes all move bytes through its one memory"
        )
    s = result.summary()
    console.print(
        f"staged/raw = {s['staged_over_raw']:.2f}x (per round, median: {s['staged_over_raw_paired']:.2f}x)   "
        f"staged/per-slice = {s['staged_over_slice']:.1f}x   "
        f"per-slice ops/staged ops = {s['slice_ops_over_staged']:,.0f}x   "
        f"(per-slice descriptors: {s['slice_descriptors']:,} per request)"
    )
    stages = result.staged_stages()
    console.print(
        f"staged, best round: {stages.pop('wall') * 1e3:.1f} ms wall; busiest rank per stage: "
        + ", ".join(f"{stage} {seconds * 1e3:.1f} ms" for stage, seconds in stages.items())
    )
    segments = result.chunk_segments()
    if segments:
        chunks = segments.pop("chunks", 0.0)
        console.print(
            f"a chunk's path (median over {chunks:.0f} chunks a round, median of rounds): "
            + ", ".join(f"{name} {segments[name] * 1e3:.3f} ms" for name in SEGMENT_ORDER if name in segments)
        )
    for check in result.checks:
        console.print(f"verified: {check}")


def json_line(result: BenchResult) -> str:
    return json.dumps(result.summary(), sort_keys=True)


def plot(result: BenchResult, path: Path) -> None:
    """Two bar charts: GB/s and transfer operations per request, both on log scales."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(result, p.name) for p in result.paths]
    colors = ["tab:green", "tab:red", "tab:gray"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, values, axis_label in (
        (left, [p.best_gbps for p in result.paths], "GB/s (best round)"),
        (right, [p.ops_per_request for p in result.paths], "transfer ops per request"),
    ):
        bars = ax.bar(names, values, color=colors)
        ax.set_yscale("log")
        ax.set_ylabel(axis_label)
        ax.bar_label(bars, labels=[f"{v:,.3g}" for v in values])
    c = result.config
    fig.suptitle(f"kvstage bench: {c.backend}, {c.model}, P{c.prefill_tp}->D{c.decode_tp}, {c.tokens} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_handoff_table(result: HandoffResult, console: Console) -> None:
    """The handoff scenario's latencies, CPU per chunk and engine interference (docs/benchmarks.md)."""
    s, b = result.summary(), result.config.bench
    title = (
        f"handoff, {b.backend} ({b.device}): {b.model}, prefill TP {b.prefill_tp} -> decode TP {b.decode_tp}, "
        f"{b.tokens} tokens in {b.chunks_per_request} chunks of {b.chunk_tokens}, page {b.page_size}, "
        f"{b.repeats} rooms, {s['gap_ms']:g} ms between chunks"
    )
    table = Table(title=title)
    for name in ("measure", "median", "p95 / p99", "note"):
        table.add_column(name, justify="left" if name in ("measure", "note") else "right")
    for key, name in (("handoff_isolated_ms", "isolated last chunk"), ("handoff_tail4_ms", "tail with 4 ready")):
        table.add_row(name, f"{s[key]['median']:.3f} ms", f"{s[key]['p95']:.3f} ms", "last kv_ready -> outcome")
    cpu, i = s["cpu_per_chunk_ms"], s["interference"]
    table.add_row("CPU per chunk, busiest rank", f"{cpu['busiest']:.3f} ms", "", cpu["busiest_rank"])
    table.add_row("engine step, idle", f"{i['idle_p50_ms']:.3f} ms", f"{i['idle_p99_ms']:.3f} ms",
                  f"{i['idle_steps']} steps")  # fmt: skip
    table.add_row("engine step, streaming", f"{i['busy_p50_ms']:.3f} ms", f"{i['busy_p99_ms']:.3f} ms",
                  f"{i['busy_steps']} steps, {i['chunk_rate_hz']:g} chunks/s")  # fmt: skip
    console.print(table)
    console.print("CPU per chunk (ms), all threads but the main one: "
                  + ", ".join(f"{rank} {ms:.3f}" for rank, ms in cpu["per_rank"].items()))  # fmt: skip
    console.print(
        f"engine step p99 streaming / idle = {i['p99_ratio']:.2f}x; streamed {i['stream_rooms']} rooms, one chunk "
        f"every {1e3 / i['chunk_rate_hz']:g} ms ({i['chunk_rate_hz']:g} Hz), landed at {i['landed_rate_hz']:.0f} Hz"
    )
    console.print(f"engine step: {i['engine_step']}")
    for check in result.checks:
        console.print(f"verified: {check}")


def handoff_json_line(result: HandoffResult) -> str:
    return json.dumps(result.summary(), sort_keys=True)
