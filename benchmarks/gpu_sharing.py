"""What sharing one GPU among rank processes costs each small GPU operation (the bound on staged/raw on one GPU).

`kvstage bench --device cuda` on a one-GPU machine runs every rank (6 for P=4 -> D=2) as its own process on the
same GPU. Without MPS the GPU runs one process's context at a time and switches between them, so an operation that
takes microseconds alone can wait for other contexts' time slices. This script measures that, apart from kvstage:

each of N processes (N in `--procs`) runs the same loop at the same moment: one device copy of `--mib` MiB, a
CUDA event recorded after it, the event polled until done (as the agents' copy threads poll theirs), then a pause
of `--gap-ms` (the agents' GPU work is sparse). Per operation it records the wall time from the launch to the
event seen done, and the device time between two events around the copy. Printed per N: the median and p90 of
the wall latency and the median device time over every process's operations, as the median (min-max) over
`--runs` runs; the last line is JSON with every run.

Usage: `python benchmarks/gpu_sharing.py [--procs 1 2 4 6] [--mib 16] [--ops 200] [--gap-ms 0.5] [--runs 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

import torch
import torch.multiprocessing as mp

WARMUP_OPS = 20


@dataclass(frozen=True)
class Run:
    procs: int
    wall_us_median: float
    wall_us_p90: float
    device_us_median: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _one_op(src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float]:
    """Copy src into dst; (wall µs from launch to the event seen done, device µs between the events)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    dst.copy_(src)
    end.record()
    while not end.query():
        pass
    wall = (time.perf_counter() - t0) * 1e6
    return wall, begin.elapsed_time(end) * 1e3


def _worker(
    rank: int, mib: int, ops: int, gap_s: float, start: Barrier, results: Queue[list[tuple[float, float]]]
) -> None:
    torch.cuda.set_device(0)
    src = torch.randn(mib << 18, device="cuda")  # float32: 4 bytes each
    dst = torch.empty_like(src)
    for _ in range(WARMUP_OPS):
        _one_op(src, dst)
    start.wait()
    timings = []
    for _ in range(ops):
        timings.append(_one_op(src, dst))
        time.sleep(gap_s)
    if not torch.equal(src, dst):
        raise AssertionError(f"process {rank}: the copy is wrong")
    results.put(timings)


def measure(procs: int, mib: int, ops: int, gap_s: float) -> Run:
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(r, mib, ops, gap_s, start, results)) for r in range(procs)]
    for w in workers:
        w.start()
    timings = [t for _ in workers for t in results.get(timeout=300)]
    for w in workers:
        w.join(timeout=60)
        if w.exitcode != 0:
            raise RuntimeError(f"a worker exited with {w.exitcode}")
    walls = [wall for wall, _ in timings]
    return Run(procs, statistics.median(walls), _percentile(walls, 0.9), statistics.median(d for _, d in timings))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--mib", type=int, default=16, help="MiB per copy (16: one staged chunk of the bench)")
    parser.add_argument("--ops", type=int, default=200, help="operations per process per run")
    parser.add_argument("--gap-ms", type=float, default=0.5, help="pause between a process's operations")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sharing.py needs a CUDA device")
    runs = [measure(n, args.mib, args.ops, args.gap_ms / 1e3) for _ in range(args.runs) for n in args.procs]
    print(f"{torch.cuda.get_device_name(0)}, {args.mib} MiB copies, {args.ops} per process, gap {args.gap_ms} ms;")
    print("median (min-max) over runs    wall µs median      wall µs p90       device µs median")
    for n in args.procs:
        mine = [r for r in runs if r.procs == n]
        cols = [_spread([getattr(r, f) for r in mine]) for f in ("wall_us_median", "wall_us_p90", "device_us_median")]
        print(f"{n} process(es)              " + "  ".join(cols))
    print(json.dumps({"mib": args.mib, "ops": args.ops, "gap_ms": args.gap_ms, "runs": [asdict(r) for r in runs]}))


if __name__ == "__main__":
    main()
