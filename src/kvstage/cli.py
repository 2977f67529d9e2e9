"""The `kvstage` command line: `demo`, `sim` and `bench`.

Owns argument parsing and nothing else; each command imports its implementation lazily so that
`kvstage --help` stays fast and a missing optional transport never breaks unrelated commands.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvstage",
    help="Hand the KV cache from prefill to decode workers across different TP sizes, through a staging ring.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _commands() -> None:
    """Hand the KV cache from prefill to decode workers across different TP sizes, through a staging ring."""


def main() -> None:
    app()


@app.command()
def demo() -> None:
    """Run the demo: an end-to-end handoff through the real agents (ZeroMQ, shared memory), verified bit for bit."""
    from kvstage.demo import print_report, run_demo

    report = run_demo()
    print_report(report)
    if not report.ok:
        raise typer.Exit(code=1)


@app.command()
def sim(
    seeds: int = typer.Option(100, "--seeds", min=1, help="How many seeds to run."),
    seed_start: int = typer.Option(0, "--seed-start", min=0, help="First seed."),
    faults: str = typer.Option("default", "--faults", help="Fault level: none, default or heavy."),
    prefill_tp: int | None = typer.Option(None, "--prefill-tp", min=1, help="Pin every prefill instance's TP size."),
    decode_tp: int | None = typer.Option(None, "--decode-tp", min=1, help="Pin every decode instance's TP size."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="Pin the model's KV head count."),
    rooms: int = typer.Option(12, "--rooms", min=1, help="Rooms per seed."),
    payloads: bool = typer.Option(
        True, "--payloads/--no-payloads", help="Move real KV bytes (checks D1), or only ownership tags (fast)."
    ),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Worker processes; results are identical for any count."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on the last stdout line."),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Run (replay) this one seed."),
    trace: bool = typer.Option(False, "--trace", help="With --seed: print every event of the run."),
) -> None:
    """Run the real protocol endpoints through seeded faults and check the invariants after every step."""
    from kvstage.errors import ConfigError
    from kvstage.sim.console import main as sim_main
    from kvstage.sim.scenario import SimConfig

    config = SimConfig(
        faults=faults, payloads=payloads, prefill_tp=prefill_tp, decode_tp=decode_tp, kv_heads=kv_heads, rooms=rooms
    )
    try:
        config.profile  # noqa: B018 - validates --faults before any world is built
        code = sim_main(
            config, seeds=seeds, seed_start=seed_start, jobs=jobs, as_json=as_json, trace_seed=seed, show_trace=trace
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(code=code)


@app.command()
def bench(
    backend: str = typer.Option("local", "--backend", help="Data transport: local, mooncake or nixl."),
    model: str = typer.Option(
        "llama3-8b", "--model", help="llama3-8b, llama3-70b, qwen2.5-7b, tiny, or a shape like L32xH8xD128:bfloat16."
    ),
    prefill_tp: int = typer.Option(4, "--prefill-tp", min=1, help="Prefill TP size (one process per rank)."),
    decode_tp: int = typer.Option(2, "--decode-tp", min=1, help="Decode TP size (one process per rank)."),
    page_size: int = typer.Option(16, "--page-size", min=1, help="Tokens per KV page."),
    tokens: int = typer.Option(4096, "--tokens", min=1, help="Tokens per request."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", min=1, help="Staging chunk grid (a page multiple)."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Requests in flight at once."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed rounds per path (best is reported)."),
    device: str = typer.Option(
        "cpu", "--device", help="Where the KV pools live: cpu, or cuda (staging stays in host memory)."
    ),
    ring_chunks: int = typer.Option(
        4, "--ring-chunks", min=1, help="Chunk regions per decode ring (and chunks per prefill staging slab)."
    ),
    writes_per_peer: int = typer.Option(
        2,
        "--writes-per-peer",
        min=1,
        help="Prefill writes in flight per decode rank; the raw path splits each pair's bytes into as many.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on the last stdout line."),
    plot_file: str | None = typer.Option(None, "--plot", help="Write a bar chart (PNG) to this file."),
) -> None:
    """Measure staged (through the agents) vs direct per-slice vs raw bulk: same backend, same bytes, one run."""
    from pathlib import Path

    from rich.console import Console

    from kvstage.bench import BenchConfig, BenchError
    from kvstage.bench.report import json_line, plot, print_table, run_with_progress
    from kvstage.errors import ConfigError

    try:
        config = BenchConfig(
            backend,
            model,
            prefill_tp,
            decode_tp,
            page_size,
            tokens,
            chunk_tokens,
            concurrency,
            repeats,
            device=device,
            ring_chunks=ring_chunks,
            writes_per_peer=writes_per_peer,
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        result = run_with_progress(config)
    except BenchError as exc:
        typer.echo(f"bench failed: {exc}", err=True)
        raise typer.Exit(code=1) from exc
    print_table(result, Console())
    if plot_file:
        plot(result, Path(plot_file))
    if as_json:
        typer.echo(json_line(result))
