"""Run the multi-process crash tests over and over, counting passes and failures per (test, backend).

The crash tests of tests/runtime/test_multiprocess.py kill a rank with SIGKILL mid-transfer: one kills a prefill
rank, its mirror the decode rank, on each backend (local, mooncake, nixl). Issue #14 asks for 50 runs in a row per
backend. This script runs all six as one pytest run per loop, never stopping at a failure, and writes:

- `OUT/loop-NNN.log` (the whole pytest output) and `OUT/loop-NNN.xml` (its JUnit report) of every loop that had
  a failure or an error, so each failure can be read afterwards;
- `OUT/summary.json`: per (test, backend) the passes, failures and the loops that failed, each loop's wall time,
  and the median and range of those times.

A loop runs under its own time limit (`--loop-timeout-s`); past it, pytest and every worker it started are killed
as a process group, and its tests count as failed. `--until HH:MM` (UTC) starts no loop that would, at the median
loop time so far, end after that time. Example, niced on a shared host:

    nice -n 10 python benchmarks/crash_loop.py --loops 50 --until 19:40 --out crash-loop
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_FILE = "tests/runtime/test_multiprocess.py"
CRASH_TESTS = {
    "prefill killed": "test_killed_prefill_rank_fails_its_rooms_as_peer_dead_and_a_restarted_rank_serves_new_rooms",
    "decode killed": "test_killed_decode_rank_fails_its_rooms_as_peer_dead_on_every_writer_and_a_restarted_rank_serves"
    "_new_rooms",
}
BACKENDS = ("local", "mooncake", "nixl")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=50, help="loops to run at most (each runs all six tests)")
    parser.add_argument("--until", help="UTC HH:MM: start no loop expected to end after it")
    parser.add_argument("--out", type=Path, default=Path("crash-loop"), help="folder for logs and summary.json")
    parser.add_argument("--loop-timeout-s", type=float, default=1200.0, help="time limit of one loop")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    return parser.parse_args()


def _deadline(until: str | None) -> dt.datetime | None:
    if until is None:
        return None
    hour, minute = (int(x) for x in until.split(":"))
    now = dt.datetime.now(dt.UTC)
    return now.replace(hour=hour, minute=minute, second=0, microsecond=0)


def _selection(backends: list[str]) -> list[str]:
    return [f"{TEST_FILE}::{test}[{backend}]" for test in CRASH_TESTS.values() for backend in backends]


def run_loop(args: argparse.Namespace, loop: int) -> tuple[dict[tuple[str, str], str], float, str]:
    """One pytest run of the crash tests: the verdict per (test, backend) ("passed", "failed", "error", "skipped",
    or "missing"), its wall time and its output."""
    xml = args.out / f"loop-{loop:03d}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *_selection(args.backends)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=args.loop_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and the workers it started (its own session)
        output, _ = proc.communicate()
        output += f"\n[crash_loop] loop {loop} killed after {args.loop_timeout_s}s\n"
    wall = time.monotonic() - started
    verdicts = {(name, backend): "missing" for name in CRASH_TESTS for backend in args.backends}
    if xml.exists():
        verdicts.update(_verdicts(xml))
    return verdicts, wall, output


def _verdicts(xml: Path) -> dict[tuple[str, str], str]:
    names = {test: name for name, test in CRASH_TESTS.items()}
    found = {}
    for case in ET.parse(xml).iter("testcase"):
        test, _, backend = case.get("name", "").partition("[")
        if test not in names:
            continue
        kinds = {child.tag for child in case}
        verdict = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        found[(names[test], backend.rstrip("]"))] = {"failure": "failed"}.get(verdict, verdict)
    return found


def main() -> None:
    args = parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = _deadline(args.until)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    failed_loops: dict[str, list[int]] = defaultdict(list)
    walls: list[float] = []
    for loop in range(1, args.loops + 1):
        if deadline is not None and walls:
            expected_end = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=statistics.median(walls))
            if expected_end > deadline:
                print(f"[crash_loop] stopping before loop {loop}: it would end after {args.until} UTC", flush=True)
                break
        verdicts, wall, output = run_loop(args, loop)
        walls.append(wall)
        for (name, backend), verdict in verdicts.items():
            key = f"{name}[{backend}]"
            counts[key][verdict] += 1
            if verdict != "passed":
                failed_loops[key].append(loop)
        if all(v == "passed" for v in verdicts.values()):
            (args.out / f"loop-{loop:03d}.xml").unlink(missing_ok=True)
        else:
            (args.out / f"loop-{loop:03d}.log").write_text(output)
        bad = {f"{n}[{b}]": v for (n, b), v in verdicts.items() if v != "passed"}
        print(f"[crash_loop] loop {loop}: {wall:.0f}s {bad or 'all passed'}", flush=True)
        _write_summary(args.out, counts, failed_loops, walls)
    _write_summary(args.out, counts, failed_loops, walls, show=True)


def _write_summary(out: Path, counts: dict[str, dict[str, int]], failed_loops: dict[str, list[int]],
                   walls: list[float], show: bool = False) -> None:  # fmt: skip
    if not walls:
        return
    summary = {
        "loops": len(walls),
        "loop_wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls), "all": walls},
        "tests": {
            key: {**dict(by_verdict), "failed_loops": failed_loops.get(key, [])}
            for key, by_verdict in sorted(counts.items())
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if show:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
