"""Side by side: `kvstage bench --handoff` on another git ref's runtime (baseline) and on this tree's (current).

Makes a temporary `git worktree` of the baseline ref, lays this tree's scenario (src/kvstage/bench/handoff.py and
handoff_stats.py, which use only the runtime's public API) over its `kvstage/bench/`, and runs the scenario
alternately, baseline then current, `--runs` times each, every invocation a fresh Python process (and fresh rank
processes) that imports `kvstage` from that side's src only: the child puts it first on `sys.path`, which
multiprocessing's spawn hands on to the rank processes, and the scenario checks that every rank imported the
parent's `kvstage`. A failed invocation stops the A/B with its error; the worktree is removed on the way out.

Prints, per metric, the median over invocations with its min-max spread for each side, and baseline/current per
paired invocation (run i of each), median with spread; then one JSON line. Scenario flags follow `--`, as for
`kvstage bench --handoff`:

    python benchmarks/handoff_ab.py --baseline 75bdf85 --runs 5 -- --backend local --model tiny \\
        --prefill-tp 2 --decode-tp 1 --tokens 4096 --chunk-tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ("handoff.py", "handoff_stats.py")
#: Run in a child: argv[1] is the kvstage src to use, argv[2] the scenario as JSON; prints the summary JSON.
CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import kvstage
from kvstage.bench.config import BenchConfig
from kvstage.bench.handoff import HandoffConfig, run_handoff
if not os.path.abspath(kvstage.__file__).startswith(os.path.abspath(sys.argv[1]) + os.sep):
    sys.exit(f"kvstage came from {kvstage.__file__}, not from {sys.argv[1]}")
spec = json.loads(sys.argv[2])
if __name__ == "__main__":
    print(json.dumps(run_handoff(HandoffConfig(BenchConfig(**spec["bench"]), **spec["handoff"])).summary()))
"""
METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "isolated handoff median (ms)": lambda s: s["handoff_isolated_ms"]["median"],
    "isolated handoff p95 (ms)": lambda s: s["handoff_isolated_ms"]["p95"],
    "tail-4 handoff median (ms)": lambda s: s["handoff_tail4_ms"]["median"],
    "tail-4 handoff p95 (ms)": lambda s: s["handoff_tail4_ms"]["p95"],
    "CPU per chunk, busiest rank (ms)": lambda s: s["cpu_per_chunk_ms"]["busiest"],
    "engine step p50 idle (ms)": lambda s: s["interference"]["idle_p50_ms"],
    "engine step p99 idle (ms)": lambda s: s["interference"]["idle_p99_ms"],
    "engine step p50 streaming (ms)": lambda s: s["interference"]["busy_p50_ms"],
    "engine step p99 streaming (ms)": lambda s: s["interference"]["busy_p99_ms"],
    "engine step p99 ratio streaming/idle": lambda s: s["interference"]["p99_ratio"],
}


def parse_args() -> tuple[argparse.Namespace, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="75bdf85", help="git ref whose runtime is the baseline")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="the baseline's src folder instead of a git ref (a checkout without git history); named by the COMMIT "
        "file beside it",
    )
    parser.add_argument("--runs", type=int, default=5, help="invocations of each side, alternating")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="deadline of one invocation")
    parser.add_argument("scenario", nargs=argparse.REMAINDER, help="-- then `kvstage bench --handoff` flags")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args, scenario_spec([a for a in args.scenario if a != "--"])


def scenario_spec(argv: list[str]) -> dict[str, Any]:
    """`kvstage bench --handoff` flags as the keyword arguments of `BenchConfig` and `HandoffConfig`."""
    sys.path.insert(0, str(ROOT / "src"))  # validated with this tree's config (each side builds its own)
    from kvstage.bench.config import BenchConfig
    from kvstage.bench.handoff import DEFAULT_GAP_MS, DEFAULT_ROOMS, HandoffConfig

    p = argparse.ArgumentParser(prog="handoff_ab.py ... --")
    for flag, kind, default in (
        ("--backend", str, "local"), ("--model", str, "llama3-8b"), ("--prefill-tp", int, 4),
        ("--decode-tp", int, 2), ("--page-size", int, 16), ("--tokens", int, 4096), ("--chunk-tokens", int, 512),
        ("--device", str, "cpu"), ("--repeats", int, DEFAULT_ROOMS), ("--ring-chunks", int, 4),
        ("--writes-per-peer", int, 2), ("--gap-ms", float, None), ("--chunk-rate-hz", float, 500.0),
        ("--stream-s", float, 2.0),
    ):  # fmt: skip
        p.add_argument(flag, type=kind, default=default)
    a = vars(p.parse_args(argv))
    gap_ms = a.pop("gap_ms")
    handoff = {
        "gap_s": (DEFAULT_GAP_MS[a["device"]] if gap_ms is None else gap_ms) / 1e3,
        "chunk_rate_hz": a.pop("chunk_rate_hz"),
        "stream_s": a.pop("stream_s"),
    }
    HandoffConfig(BenchConfig(**a), **handoff)  # a bad flag fails here, before any worktree
    return {"bench": a, "handoff": handoff}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def commit_of(tree: Path) -> str:
    """The commit of `tree`: what a `COMMIT` file beside its src says (a copied tree, such as `.base/`, may lie
    inside another checkout, whose HEAD is not its commit), else its git HEAD, else "unknown"."""
    marker = tree / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return head.stdout.strip() if head.returncode == 0 else "unknown"


def copy_baseline(src: Path, where: Path) -> str:
    """A copy of the baseline tree whose src is `src` at `where`, with this tree's scenario over its bench package."""
    shutil.copytree(src, where / "src")
    for name in SCENARIO:
        shutil.copyfile(ROOT / "src" / "kvstage" / "bench" / name, where / "src" / "kvstage" / "bench" / name)
    return commit_of(src.parent)


def add_baseline(ref: str, where: Path) -> str:
    """A worktree of `ref` at `where`, with this tree's scenario over its bench package; returns its commit."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    git("worktree", "add", "--detach", str(where), commit)
    for name in SCENARIO:
        shutil.copyfile(ROOT / "src" / "kvstage" / "bench" / name, where / "src" / "kvstage" / "bench" / name)
    return commit


def invoke(src: Path, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One invocation of the scenario with `kvstage` from `src`: its summary, or SystemExit with its error."""
    env = dict(os.environ)  # a kvstage on PYTHONPATH is passed over: the child puts `src` first on its path
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not (Path(p) / "kvstage").is_dir())  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout_s, check=False, env=env, cwd=src.parent,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"the scenario failed with kvstage from {src}:\n{proc.stderr[-4000:]}")
    summary: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def compare(baseline: list[dict[str, Any]], current: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: each side's spread over invocations, and baseline/current per paired invocation."""
    out = {}
    for name, metric in METRICS.items():
        a, b = [metric(s) for s in baseline], [metric(s) for s in current]
        out[name] = {"baseline": spread(a), "current": spread(b),
                     "ratio": spread([x / y for x, y in zip(a, b, strict=True)])}  # fmt: skip
    return out


def stages(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over invocations of each stage's offset in the isolated handoff's last chunk (stages every run saw,
    in the order of those medians; a runtime without the marks of a stage has none)."""
    seen = [run.get("handoff_isolated_stages_ms", {}) for run in runs]
    common = set.intersection(*(set(s) for s in seen)) if seen else set()
    medians = {stage: statistics.median(s[stage] for s in seen) for stage in common}
    return dict(sorted(medians.items(), key=lambda item: item[1]))


def show_stages(sides: dict[str, dict[str, float]]) -> None:
    print("isolated handoff, the last chunk: ms from its kv_ready to each stage (median over invocations)")
    for side, offsets in sides.items():
        print(f"  {side:<9} " + ", ".join(f"{stage} {ms:.3f}" for stage, ms in offsets.items()))


def show(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def report(rows: dict[str, dict[str, Any]], header: str) -> None:
    print(header)
    print(f"{'metric':<38} {'baseline':>26} {'current':>26} {'baseline/current':>26}")
    for name, row in rows.items():
        print(f"{name:<38} {show(row['baseline']):>26} {show(row['current']):>26} {show(row['ratio']):>26}")
    print("median over invocations [min-max]; the ratio is per paired invocation (run i of each side)")


def main() -> None:
    args, spec = parse_args()
    current_commit = commit_of(ROOT)
    if current_commit != "unknown" and (ROOT / ".git").exists() and git("status", "--porcelain", "src"):
        current_commit += "+changes"
    tmp = Path(tempfile.mkdtemp(prefix="kvstage-handoff-ab-"))
    worktree = tmp / "baseline"
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    try:
        if args.baseline_src is None:
            baseline_commit = add_baseline(args.baseline, worktree)
        else:
            baseline_commit = copy_baseline(args.baseline_src.resolve(), worktree)
        if args.baseline_src is not None:  # named by its COMMIT file, not by --baseline's default
            args.baseline = baseline_commit[:7]
        sides = {"baseline": worktree / "src", "current": ROOT / "src"}
        for i in range(args.runs):
            for side, src in sides.items():
                print(f"run {i + 1}/{args.runs}: {side}", file=sys.stderr, flush=True)
                runs[side].append(invoke(src, spec, args.timeout_s))
    finally:
        if worktree.exists() and args.baseline_src is None:
            git("worktree", "remove", "--force", str(worktree))
        shutil.rmtree(tmp, ignore_errors=True)
    rows = compare(runs["baseline"], runs["current"])
    breakdown = {side: stages(side_runs) for side, side_runs in runs.items()}
    b, h = spec["bench"], spec["handoff"]
    report(rows, f"handoff A/B: baseline {args.baseline} ({baseline_commit[:10]}) vs current ({current_commit[:10]}"
           f"{'+changes' if current_commit.endswith('+changes') else ''}), {args.runs} invocations each; "
           f"{b['backend']} {b['device']} {b['model']} P{b['prefill_tp']}->D{b['decode_tp']}, {b['tokens']} tokens, "
           f"chunk {b['chunk_tokens']}, {b['repeats']} rooms, gap {h['gap_s'] * 1e3:g} ms, "
           f"{h['chunk_rate_hz']:g} chunks/s streamed")  # fmt: skip
    show_stages(breakdown)
    print(json.dumps({"baseline": args.baseline, "baseline_commit": baseline_commit, "current_commit": current_commit,
                      "runs": args.runs, "scenario": spec, "metrics": rows, "stages_ms": breakdown},
                     sort_keys=True))  # fmt: skip


if __name__ == "__main__":
    main()
