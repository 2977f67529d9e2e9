"""Run the multi-process crash tests over and over, counting passes and failures per (test, backend).

The crash tests of tests/runtime/test_multiprocess.py kill a rank with SIGKILL mid-transfer: one kills a prefill
rank, its mirror the decode rank, on each backend (local, mooncake, nixl). Issue #14 asks for 50 runs in a row per
backend. This script runs all six as one pytest run per loop, never stopping at a failure, and writes:

- `OUT/loop-NNN.log` (the whole pytest output) and `OUT/loop-NNN.xml` (its JUnit report) of every loop that had
  a failure or an error, so each failure can be read afterwards;
- `OUT/summary.json`: per (test, backend) the passes, failures and the loops that did not pass, the median and
  range of the loops' wall times, and the commits they ran on ("+dirty": with others' uncommitted changes).

A loop runs under its own time limit (`--loop-timeout-s`); past it, pytest and every worker it started are killed
as a process group, and its tests that did not report count as "missing". `--until HH:MM` (UTC) starts no loop
that would, at the median loop time so far, end after that time. Example, niced on a shared host:

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _commit() -> str:
    """The commit the loop runs on, marked "+dirty" where the working tree has changes (others' work in progress)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout  # fmt: skip
    return head.strip() + ("+dirty" if dirty.strip() else "")


@dataclass(frozen=True)
class Loop:
    """One pytest run of the crash tests: the verdict per (test, backend) ("passed", "failed", "error", "skipped",
    or "missing"), its wall time, the commit it ran on and its output."""

    number: int
    verdicts: dict[tuple[str, str], str]
    wall_s: float
    commit: str
    output: str

    def bad(self) -> dict[str, str]:
        return {f"{name}[{backend}]": v for (name, backend), v in self.verdicts.items() if v != "passed"}


def run_loop(args: argparse.Namespace, number: int) -> Loop:
    commit = _commit()
    xml = args.out / f"loop-{number:03d}.xml"
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
        output += f"\n[crash_loop] loop {number} killed after {args.loop_timeout_s}s\n"
    wall = time.monotonic() - started
    verdicts = {(name, backend): "missing" for name in CRASH_TESTS for backend in args.backends}
    if xml.exists():
        verdicts.update(_verdicts(xml))
    loop = Loop(number, verdicts, wall, commit, f"[crash_loop] loop {number} on {commit}\n{output}")
    if loop.bad():
        (args.out / f"loop-{number:03d}.log").write_text(loop.output)
    else:
        xml.unlink(missing_ok=True)
    return loop


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
    loops: list[Loop] = []
    for number in range(1, args.loops + 1):
        if deadline is not None and loops:
            median = statistics.median(loop.wall_s for loop in loops)
            if dt.datetime.now(dt.UTC) + dt.timedelta(seconds=median) > deadline:
                print(f"[crash_loop] stopping before loop {number}: it would end after {args.until} UTC", flush=True)
                break
        loops.append(loop := run_loop(args, number))
        print(f"[crash_loop] loop {number} on {loop.commit}: {loop.wall_s:.0f}s {loop.bad() or 'all passed'}",
              flush=True)  # fmt: skip
        (args.out / "summary.json").write_text(json.dumps(summary(loops), indent=1))
    print(json.dumps(summary(loops), indent=1))


def summary(loops: list[Loop]) -> dict[str, Any]:
    """Per (test, backend): how many loops gave each verdict and which loops did not pass; the loops' wall times."""
    tests: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(int))
    for loop in loops:
        for (name, backend), verdict in sorted(loop.verdicts.items()):
            tests[f"{name}[{backend}]"][verdict] += 1
    for key, by_verdict in tests.items():
        by_verdict["not_passed_in_loops"] = [loop.number for loop in loops if key in loop.bad()]
    walls = [loop.wall_s for loop in loops]
    return {
        "loops": len(loops),
        "loop_wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)} if walls else {},
        "tests": {key: dict(by_verdict) for key, by_verdict in sorted(tests.items())},
        "commits": sorted({loop.commit for loop in loops}),
    }


if __name__ == "__main__":
    main()
