"""Smoke test of `benchmarks/host_ceiling.py`: the real script, real rank processes, the local backend.

Checks what the script promises, never how fast anything is: every mode of every counted round moved the
topology's bytes at a positive rate, and the reported ratios are the medians of the per-round ratios.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from kvstage.bench.config import BenchConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_ceiling.py"


def test_host_ceiling_measures_each_mode_over_real_ranks_and_reports_the_paired_median_ratios() -> None:
    repeats = 2
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "local", "--model", "tiny", "--prefill-tp", "2", "--decode-tp",
         "1", "--tokens", "256", "--chunk-tokens", "64", "--repeats", str(repeats), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bytes"] == BenchConfig("local", "tiny", 2, 1, 16, 256, 64).moved_bytes
    rows = result["gbps"]
    assert set(rows) == {"raw", "chunked", "copies", "chunked+copies", "copies beside writes"}
    assert all(len(values) == repeats and min(values) > 0 for values in rows.values())
    paired = statistics.median(c / r for c, r in zip(rows["chunked+copies"], rows["raw"], strict=True))
    assert result["ceiling"] == paired
    assert result["chunked_over_raw"] == statistics.median(
        c / r for c, r in zip(rows["chunked"], rows["raw"], strict=True)
    )
    assert "ceiling (chunked+copies / raw)" in proc.stdout
