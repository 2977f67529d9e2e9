"""Smoke test of `kvstage bench --handoff`: the real command, in a subprocess, with real rank processes on the local
backend and the tiny model.

Checks what the command promises, never how fast it is: the last stdout line is one JSON object with every key,
every latency, CPU and step time is positive, there is one sample per timed room, the arithmetic between the
reported numbers holds, and both checks (bytes of the warm-up room, every room successful) were made. Sizes are
small so this stays well under 30 s on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-c", "from kvstage.cli import main; main()", "bench", "--handoff"]
ROOMS = 3
# tiny: 4 layers, 4 KV heads, head_dim 64; prefill TP 2 -> decode TP 1; 512 tokens in 8 chunks of 64.
ARGS = ("--backend", "local", "--model", "tiny", "--prefill-tp", "2", "--decode-tp", "1", "--tokens", "512",
        "--chunk-tokens", "64", "--page-size", "16", "--repeats", str(ROOMS), "--gap-ms", "10",
        "--chunk-rate-hz", "200", "--stream-s", "0.3")  # fmt: skip


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "300"}  # rich wraps error boxes at the terminal's width
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env)


def test_handoff_json_line_reports_latencies_cpu_and_interference() -> None:
    proc = _run(*ARGS, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert result["scenario"] == "handoff"
    for key in ("handoff_isolated_ms", "handoff_tail4_ms"):
        latency = result[key]
        assert len(latency["samples"]) == ROOMS, latency
        assert all(ms > 0 for ms in latency["samples"]), latency
        assert min(latency["samples"]) <= latency["median"] <= latency["p95"] <= max(latency["samples"]), latency
    cpu = result["cpu_per_chunk_ms"]
    assert set(cpu["per_rank"]) == {"prefill 0", "prefill 1", "decode 0"}, cpu
    assert all(ms > 0 for ms in cpu["per_rank"].values()), cpu
    assert cpu["busiest"] == max(cpu["per_rank"].values()) == cpu["per_rank"][cpu["busiest_rank"]], cpu
    steps = result["interference"]
    for key in ("idle_p50_ms", "idle_p99_ms", "busy_p50_ms", "busy_p99_ms", "p99_ratio", "landed_rate_hz"):
        assert steps[key] > 0, (key, steps)
    assert steps["idle_p50_ms"] <= steps["idle_p99_ms"] and steps["busy_p50_ms"] <= steps["busy_p99_ms"], steps
    assert steps["p99_ratio"] == steps["busy_p99_ms"] / steps["idle_p99_ms"]
    assert steps["chunk_rate_hz"] == 200
    assert steps["stream_chunks"] == steps["stream_rooms"] * 8 == 64  # 0.3 s at 200 Hz: 60 chunks, whole rooms
    assert steps["idle_steps"] > 0 and steps["busy_steps"] > 0, steps
    assert (result["chunks"], result["rooms"], result["gap_ms"]) == (8, ROOMS, 10.0)
    assert len(result["verified"]) == 2, result["verified"]
    assert f"{1 + 2 * ROOMS + steps['stream_rooms']} rooms" in result["verified"][1]
    assert "isolated last chunk" in proc.stdout and "engine step" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tokens", "192", "--chunk-tokens", "64"), "at least 4 chunks"),
        (("--gap-ms", "0"), "--gap-ms must be a positive number"),
        (("--concurrency", "2"), "--concurrency must be 1"),
        (("--plot", "x.png"), "neither --slice-rounds nor --plot"),
    ],
)
def test_handoff_rejects_what_it_cannot_measure_naming_the_flag(args: tuple[str, ...], message: str) -> None:
    proc = _run("--model", "tiny", "--chunk-tokens", "64", "--tokens", "512", *args, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
