"""What `kvstage sim` prints: a progress bar, the summary table, violation reports and `--trace` replays.

Owns `main`, the body of the `sim` command (cli.py only parses arguments and calls it). Human output goes to
stderr while seeds run and the summary table to stdout; with `--json` the last stdout line is the JSON summary.
Returns the process exit code: 0 when no invariant was violated (and, with `--faults none`, every room
succeeded), 1 otherwise.

Called by cli.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvstage.sim.runner import Summary, run_seed, run_seeds
from kvstage.sim.scenario import SimConfig
from kvstage.sim.world import RunResult


def main(
    config: SimConfig,
    *,
    seeds: int,
    seed_start: int,
    jobs: int,
    as_json: bool,
    trace_seed: int | None,
    show_trace: bool,
) -> int:
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    if trace_seed is not None:
        return _replay(config, trace_seed, show_trace, as_json, out)
    summary = _run_with_progress(config, range(seed_start, seed_start + seeds), jobs, err, quiet=as_json)
    for violation in summary.violations[:3]:
        _print_violation(violation, config, err if as_json else out)
    if as_json:
        print(json.dumps(summary.to_json()))
    else:
        _print_tables(summary, config, out)
    return 1 if summary.violations else 0


def _print_tables(summary: Summary, config: SimConfig, out: Console) -> None:
    out.print(_table(summary, config))
    if summary.failed_by_reason:
        out.print(_reasons(summary))


def _run_with_progress(config: SimConfig, seeds: range, jobs: int, err: Console, *, quiet: bool) -> Summary:
    if quiet or len(seeds) < 20:
        return run_seeds(seeds, config, jobs=jobs)
    columns = (TextColumn("sim [{task.description}]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(config.faults, total=len(seeds))
        found = 0

        def advance(result: RunResult) -> None:
            nonlocal found
            found += len(result.violations)
            progress.update(task, advance=1, description=f"{config.faults}, {found} violations")

        return run_seeds(seeds, config, jobs=jobs, on_result=advance)


def _replay(config: SimConfig, seed: int, show_trace: bool, as_json: bool, out: Console) -> int:
    result = run_seed(seed, config, keep_trace=show_trace)
    summary = Summary()
    summary.add(result, config.profile.name)
    if show_trace:
        for line in result.trace:
            print(line)
        print(f"# seed {seed}: {result.events} endpoint events, trace digest {result.digest}")
    for violation in summary.violations:
        _print_violation(violation, config, out, with_trace=not show_trace)
    if as_json:
        print(json.dumps(summary.to_json()))
    else:
        _print_tables(summary, config, out)
    return 1 if summary.violations else 0


def _print_violation(violation: dict[str, Any], config: SimConfig, console: Console, with_trace: bool = True) -> None:
    console.print(f"[bold red]VIOLATION {violation['invariant']}[/] seed {violation['seed']}: {violation['detail']}")
    if with_trace and violation["trace"]:
        console.print(f"last {len(violation['trace'])} events:")
        for line in violation["trace"]:
            console.print(line, markup=False)
    flags = f" --faults {config.faults}" + ("" if config.payloads else " --no-payloads")
    if config.rooms != SimConfig().rooms:
        flags += f" --rooms {config.rooms}"
    for name, value in (
        ("prefill-tp", config.prefill_tp),
        ("decode-tp", config.decode_tp),
        ("kv-heads", config.kv_heads),
    ):
        if value is not None:
            flags += f" --{name} {value}"
    console.print(f"replay: kvstage sim --seed {violation['seed']}{flags} --trace")


def _table(summary: Summary, config: SimConfig) -> Table:
    table = Table(title=f"kvstage sim: faults={config.faults}, payloads={'on' if config.payloads else 'off'}")
    for name in ("seeds", "rooms", "succeeded", "failed", "violations", "events", "events/s", "core events/s"):
        table.add_column(name, justify="right")
    style = "bold red" if summary.violations else "green"
    table.add_row(
        str(summary.seeds),
        str(summary.rooms),
        str(summary.succeeded),
        str(summary.failed),
        f"[{style}]{len(summary.violations)}[/]",
        str(summary.events),
        f"{summary.events_per_second:,.0f}",
        f"{summary.core_events_per_second:,.0f}",
    )
    return table


def _reasons(summary: Summary) -> Table:
    table = Table(title="failed rooms by first reason")
    table.add_column("reason")
    table.add_column("rooms", justify="right")
    for reason, count in sorted(summary.failed_by_reason.items(), key=lambda item: (-item[1], item[0])):
        table.add_row(reason, str(count))
    return table


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `kvstage sim`")
