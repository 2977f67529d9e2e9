"""The vLLM connector's host time per engine step on a GPU: what kvstage adds to each step of vLLM's engine loop.

Replays `tests/integrations/traces/busy8.json` (a recorded run of vLLM's own scheduler: 8 requests of 512 tokens
in every prefill step, chunked 128 tokens each, prefill TP 2 to decode TP 1; `tests/integrations/worker_replay.py`)
on worker sides whose KV is GPU tensors in vLLM's NHD layout with a Llama-3-8B rank's shape (32 layers, 8 KV heads
of 128, bf16), staged in device memory over cuda_ipc. Per engine step it takes the host time of one worker's hooks
(handle_preemptions + bind_connector_metadata, wait_for_save, one get_transfer_results), inside a guard that fails
the run if any of them makes the host wait for the GPU. Printed per role: the median of each run's per-step times,
as the median (min-max) over `--runs` runs, and the p99 over every step of every run; the last line is JSON with
every step's time.

Usage (on a GPU host, from the repository root): `python benchmarks/connector_step_time.py [--runs 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "integrations")]

from worker_replay import TRACES, Replay, Shape, Trace, no_host_sync  # noqa: E402

from kvstage.transport.bootstrap import BootstrapServer  # noqa: E402

SHAPE = Shape("LBNHC", "cuda", torch.bfloat16, "auto", num_layers=32, num_kv_heads=8, head_dim=128)


def one_run(trace: Trace) -> dict[str, list[float]]:
    """Host microseconds of one worker's hooks per engine step, by role, over one replay of the trace."""
    server = BootstrapServer().start()
    replay = Replay(trace, SHAPE, server.address)
    try:
        replay.run(guard=no_host_sync)
    finally:
        replay.close()
        server.close()
    return {"prefill": [t * 1e6 for t in replay.times.prefill], "decode": [t * 1e6 for t in replay.times.decode]}


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    trace = Trace.load(TRACES / "busy8.json")
    one_run(trace)  # warm-up: Triton compiles the gather and scatter kernels
    runs = [one_run(trace) for _ in range(args.runs)]
    for role in ("prefill", "decode"):
        medians = [statistics.median(run[role]) for run in runs]
        pooled = [t for run in runs for t in run[role]]
        print(
            f"{role:8s} per-step median {statistics.median(medians):7.1f} us ({min(medians):.1f}-{max(medians):.1f}"
            f" over {args.runs} runs); p99 of all {len(pooled)} steps {p99(pooled):7.1f} us"
        )
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
