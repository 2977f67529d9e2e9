"""Smoke test of `benchmarks/cpu_kv_path.py`: the real script on a small model.

Checks what the script promises, never how fast anything is: every path is timed once per run, side by side with the
plain copy, the block's bytes are the writer block's, and each printed ratio is the median of the per-run ratios.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_kv_path.py"


def test_cpu_kv_path_times_every_path_per_run_and_reports_the_median_ratios() -> None:
    runs = 2
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "L2xH4xD8", "--dtype", "float16", "--block-size", "16", "--tokens",
         "40", "--offset", "5", "--heads", "2", "--head-start", "1", "--planes", "--runs", str(runs), "--repeats",
         "1", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bytes"] == 2 * 2 * 40 * 2 * 8 * 2  # K and V, layers, tokens, heads, head_dim, bytes
    rows = result["ms_per_token"]
    assert list(rows) == ["copy", "gather", "scatter", "gather-planes", "scatter-planes"]
    assert all(len(values) == runs and min(values) > 0 for values in rows.values())
    gather = statistics.median(g / c for g, c in zip(rows["gather"], rows["copy"], strict=True))
    assert f"{gather:14.2f}" in proc.stdout.splitlines()[3]
