"""Where the reactors' CPU goes: a summary of py-spy's raw samples of the agents' reactor threads.

`gpu_session.sh profile_p2d1` records one `kvstage bench --handoff` invocation with `py-spy record --subprocesses
--nonblocking -f raw` (every rank process; the py-spy wheel goes in .whl/ like the others) and runs this on the
result. Only samples whose stack passes through the reactor's loop (`BaseAgent._run`, or `--key`) count; the rest
(the bench's main thread, the stand-in engine, the resolver) are left out. Printed: samples per process, then each
function's share of the reactor samples, inclusive (it or anything it called was running) and self (it was the
innermost Python frame, native code it called included), largest first.

Usage: `python benchmarks/reactor_profile.py SAMPLES.txt [--key BaseAgent._run] [--top 40]`.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LOCATION = re.compile(r" \(([^:]*/)?([^/:]+):\d+\)")


def summarize(path: Path, key: str) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """(reactor samples, samples per process, inclusive samples per function, self samples per function)."""
    total, processes, inclusive, own = 0, Counter[str](), Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(key in frame for frame in frames):
            continue
        n = int(count)
        total += n
        processes[next(f for f in reversed(frames) if f.startswith("process ")).split(":")[0]] += n
        functions = [_LOCATION.sub(r" (\2)", f) for f in frames if _LOCATION.search(f)]  # no process labels
        inclusive.update(dict.fromkeys(set(functions), n))
        own[functions[-1]] += n
    return total, processes, inclusive, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", type=Path, help="py-spy's `-f raw` output")
    parser.add_argument("--key", default="BaseAgent._run", help="a frame every counted stack passes through")
    parser.add_argument("--top", type=int, default=40, help="functions listed per table")
    args = parser.parse_args()
    total, processes, inclusive, own = summarize(args.samples, args.key)
    if not total:
        raise SystemExit(f"no sample in {args.samples} passes through {args.key!r}")
    print(f"{total} reactor samples: " + ", ".join(f"{p} {n}" for p, n in processes.most_common()))
    for title, table in (("inclusive", inclusive), ("self", own)):
        print(f"--- {title}")
        for function, n in table.most_common(args.top):
            print(f"{100 * n / total:5.1f}% {function}")


if __name__ == "__main__":
    main()
