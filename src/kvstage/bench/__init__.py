"""`kvstage bench`: the staged path through the runtime agents against the direct per-slice path and a raw bulk
write, on one backend, with the same bytes, in one run.

`config` (what to run), `worker` (one rank per process), `runner` (the sequence, verification and timing) and
`report` (progress, table, JSON, plot); `handoff` (with `handoff_stats`) is `--handoff`, the latency scenario.
Called by the CLI; docs/benchmarks.md explains the numbers.
"""

from kvstage.bench.config import MODEL_PRESETS, BenchConfig, parse_model
from kvstage.bench.runner import BenchError, BenchResult, PathResult, run_bench

__all__ = ["MODEL_PRESETS", "BenchConfig", "BenchError", "BenchResult", "PathResult", "parse_model", "run_bench"]
