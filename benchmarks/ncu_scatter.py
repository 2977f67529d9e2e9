"""Where the scatter's time goes against a copy: one launch each, for Nsight Compute (`ncu`) to profile.

Launches, inside a profiler range (`ncu --profile-from-start off` profiles only these), one Triton `_stream_copy`
(a plain copy of the writer block's bytes: 16 KiB per program, 8 warps, like the scatter's tiles), one scatter and
one gather through `dataplane.kernels` (both `_copy_kernel`), for the block of `benchmarks/gather_scatter.py`'s
case (Llama-3-8B, P=4->D=2, bf16, page 16; `--tokens`, default 16384). Before the range it times each path (and
torch's device-to-device memcpy, which `ncu` does not profile) with CUDA events: median of `--repeats` timings of
10 calls each, fresh random pages per run. `--summarize RAW.csv` reads `ncu --page raw --csv` of the report and
prints the key metrics per kernel (time, DRAM throughput and bytes, sectors per request, occupancy, top stalls).

Usage (benchmarks/gpu_session.sh, step ncu_scatter):
  ncu --set full --clock-control none --profile-from-start off --kernel-name regex:'_copy_kernel|_stream_copy' \
      -o REPORT python3 benchmarks/ncu_scatter.py
  ncu --import REPORT.ncu-rep --page raw --csv > raw.csv; python3 benchmarks/ncu_scatter.py --summarize raw.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics

import torch
import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]
from gather_scatter import Case, Setup

#: Metrics printed per kernel, with their labels (ncu 2025 names).
KEY_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput % of peak",
    "dram__bytes_read.sum": "DRAM read",
    "dram__bytes_write.sum": "DRAM write",
    "lts__t_sector_hit_rate.pct": "L2 hit rate %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy %",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical occupancy %",
    "launch__registers_per_thread": "registers/thread",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__waves_per_multiprocessor": "waves/SM",
    "smsp__inst_executed.sum": "instructions",
}
SECTORS = {
    "load": ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"),
    "store": ("l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"),
}
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


@triton.jit  # type: ignore[untyped-decorator]
def _stream_copy(src, dst, n, TILE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Copy `n` bytes from `src` to `dst`, `TILE` bytes per program."""
    at = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    tl.store(dst + at, tl.load(src + at, mask=at < n), mask=at < n)


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() not in ("", "n/a") else float("nan")


def summarize(path: str) -> dict[str, dict[str, object]]:
    """Key metrics per profiled kernel (in launch order) from `ncu --page raw --csv`."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, units, kernels = rows[0], rows[1], rows[2:]
    out: dict[str, dict[str, object]] = {}
    names = ["stream-copy", "scatter", "gather"]
    for index, row in enumerate(kernels):
        value = dict(zip(header, row, strict=False))
        unit = dict(zip(header, units, strict=False))
        label = names[index] if index < len(names) else f"kernel {index}"
        entry: dict[str, object] = {"kernel": value.get("Kernel Name", "")}
        for metric, name in KEY_METRICS.items():
            if metric in value:
                entry[name] = f"{value[metric]} {unit.get(metric, '')}".strip()
        for kind, (sectors, requests) in SECTORS.items():
            if sectors in value and requests in value and _number(value[requests]):
                entry[f"sectors/request ({kind})"] = round(_number(value[sectors]) / _number(value[requests]), 2)
        stalls = {
            metric[len(STALL[0]) : -len(STALL[1])]: _number(value[metric])
            for metric in header
            if metric.startswith(STALL[0]) and metric.endswith(STALL[1]) and "not_issued" not in metric
        }
        top = sorted(((v, k) for k, v in stalls.items() if v == v), reverse=True)[:5]
        entry["top stalls (cycles per issued instruction)"] = {k: round(v, 2) for v, k in top}
        out[label] = entry
    return out


def profile(tokens: int, runs: int, repeats: int) -> dict[str, object]:
    device = torch.device("cuda")
    setup = Setup(Case(tokens, 16, "bfloat16", 4, 2, 32, 8, 128), device)
    nbytes = setup.block.nbytes
    setup.staging.copy_(torch.randint(0, 256, setup.staging.shape, dtype=torch.uint8, device=device))
    source, target = setup.staging[:nbytes], setup.spare
    tile = 16384
    paths = {
        "memcpy": setup.copy,
        "stream-copy": lambda: _stream_copy[(triton.cdiv(nbytes, tile),)](
            source, target, nbytes, TILE=tile, num_warps=8
        ),
        **setup.triton_paths(None),
    }
    torch.bitwise_not(source, out=target)  # every byte differs from the source until the copy has written it
    paths["stream-copy"]()
    assert torch.equal(target, source), "the stream copy did not copy the block"
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(runs):
        setup.draw()
        for name, fn in paths.items():
            for _ in range(3):
                fn()
            samples = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / 10)
            seconds[name].append(statistics.median(samples))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name in ("stream-copy", "scatter-triton", "gather-triton"):
        paths[name]()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    table = {
        name: {
            "GB/s median": round(nbytes / statistics.median(s) / 1e9, 1),
            "GB/s min-max": [round(nbytes / max(s) / 1e9, 1), round(nbytes / min(s) / 1e9, 1)],
            "x memcpy median": round(statistics.median(m / x for m, x in zip(seconds["memcpy"], s, strict=True)), 3),
        }
        for name, s in seconds.items()
    }
    return {"case": str(setup.case), "block_bytes": nbytes, "runs": runs, "timings": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--summarize", metavar="RAW_CSV", help="print key metrics from `ncu --page raw --csv`")
    args = parser.parse_args()
    result = summarize(args.summarize) if args.summarize else profile(args.tokens, args.runs, args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
