"""Smoke test of `kvstage bench`: the real command, in a subprocess, with real rank processes on the local backend.

Checks what the command promises, not how fast it is (performance is measured by the bench itself, never by
timed assertions): the last stdout line is the JSON object with every required key; every path moved bytes at a
positive rate; the transfer operations per request are exactly what the layout arithmetic says for each path;
the bytes were verified on both sides; the plot is written. Sizes are tiny so this stays well under 30 s.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstage.layout import plan_head_transfers

CLI = [sys.executable, "-c", "from kvstage.cli import main; main()", "bench"]
REQUIRED = ("staged_gbps", "slice_gbps", "raw_gbps", "staged_over_raw", "staged_over_slice", "ops_staged", "ops_slice")

# tiny = 4 layers, 4 KV heads, head_dim 64; prefill TP 2 -> decode TP 1; 256 tokens in pages of 16, chunks of 64.
LAYERS, HEADS, TOKENS, PAGE, CHUNK, PREFILL_TP, DECODE_TP = 4, 4, 256, 16, 64, 2, 1
WINDOW = 3  # writes in flight per (writer, reader) pair: the staged path's window and the raw path's parts


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_bench_json_line_reports_three_verified_paths_with_the_expected_operation_counts(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    proc = _run(
        "--backend", "local", "--model", "tiny", "--prefill-tp", str(PREFILL_TP), "--decode-tp", str(DECODE_TP),
        "--tokens", str(TOKENS), "--page-size", str(PAGE), "--chunk-tokens", str(CHUNK), "--concurrency", "2",
        "--writes-per-peer", str(WINDOW), "--repeats", "2", "--slice-rounds", "1", "--json", "--plot", str(plot),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    for key in REQUIRED:
        assert key in result, f"missing {key} in {sorted(result)}"
    for key in ("staged_gbps", "slice_gbps", "raw_gbps"):
        assert 0 < result[key] < 1000, (key, result[key])
    assert result["staged_over_raw"] == result["staged_gbps"] / result["raw_gbps"]
    assert result["staged_over_slice"] == result["staged_gbps"] / result["slice_gbps"]
    assert [len(result["seconds"][path]) for path in ("staged", "slice", "raw")] == [2, 1, 2]  # --slice-rounds 1
    rounds = zip(result["seconds"]["staged"], result["seconds"]["raw"], strict=True)
    assert result["staged_over_raw_paired"] == statistics.median(raw / staged for staged, raw in rounds)

    writers = len(plan_head_transfers(HEADS, PREFILL_TP, DECODE_TP))  # (prefill, decode) pairs with a block
    pages = TOKENS // PAGE
    assert result["ops_staged"] == (TOKENS // CHUNK) * writers  # one bulk write per writer per chunk
    assert result["ops_raw"] == writers * WINDOW  # each writer's bytes as WINDOW contiguous writes at once
    assert result["slice_descriptors"] == LAYERS * 2 * pages * writers  # layer x K/V x page x head run
    # A prefill rank's 2 heads fill half of each decode slot row (4 heads), so every slice is strided: one write
    # per token row.
    assert result["ops_slice"] == result["slice_descriptors"] * PAGE
    assert result["bytes_per_request"] == TOKENS * 2 * LAYERS * HEADS * 64 * 2
    assert len(result["verified"]) == 3, result["verified"]
    stages = result["staged_stages_s"]  # the best staged round, and each stage's busiest rank within it
    assert set(stages) == {"wall", "gather", "transfer", "scatter", "reactor cpu"}, stages
    assert all(0 < stages[stage] <= stages["wall"] for stage in ("gather", "transfer", "scatter")), stages
    assert stages["reactor cpu"] > 0, stages
    segments = result["chunk_segments_s"]  # a chunk's path, from every rank's chunk stamps
    assert segments["chunks"] == (TOKENS // CHUNK) * 2 * DECODE_TP, segments  # 2 requests, each decode rank's chunks
    slowest = max(result["seconds"]["staged"])  # segments are medians over rounds; each within its round's wall
    for name in ("grant hop", "gather", "write", "ready hop", "scatter", "land", "latency", "period"):
        assert 0 <= segments[name] < slowest, (name, segments)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "staged (agents)" in proc.stdout and "staged/raw" in proc.stdout


def test_bench_rejects_an_unknown_model_naming_the_flag() -> None:
    proc = _run("--model", "gpt-17", timeout=60)
    assert proc.returncode == 2
    assert "--model 'gpt-17'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_on_cuda_without_a_gpu_says_so_before_starting_any_rank() -> None:
    proc = _run("--model", "tiny", "--tokens", "64", "--chunk-tokens", "64", "--device", "cuda", timeout=60)
    assert proc.returncode == 1
    assert "--device cuda needs a CUDA GPU" in proc.stderr


def test_bench_rejects_an_unknown_device_naming_the_flag() -> None:
    proc = _run("--device", "tpu", timeout=60)
    assert proc.returncode == 2
    assert "--device 'tpu'" in proc.stderr


def test_gpu_placement_gives_each_instance_gpus_of_its_own_where_the_host_has_enough(monkeypatch) -> None:
    from kvstage.bench import BenchConfig
    from kvstage.bench.worker import DECODE, PREFILL, pool_device

    config = BenchConfig("local", "tiny", 2, 1, 16, 64, 64, device="cuda")
    for gpus, prefill, decode in ((8, ["cuda:0", "cuda:1"], ["cuda:2"]), (2, ["cuda:0", "cuda:1"], ["cuda:0"])):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert [pool_device(config, PREFILL, r) for r in range(2)] == prefill
        assert [pool_device(config, DECODE, 0)] == decode
    assert pool_device(BenchConfig("local", "tiny", 2, 1, 16, 64, 64), DECODE, 0) == "cpu"


@pytest.mark.slow  # rank processes and three paths: about 20 s on 2 cores
def test_bench_at_matched_tp_reports_the_agents_direct_path_with_its_bytes_and_ops() -> None:
    proc = _run(
        "--backend", "local", "--model", "tiny", "--prefill-tp", "2", "--decode-tp", "2", "--tokens", str(TOKENS),
        "--page-size", str(PAGE), "--chunk-tokens", str(CHUNK), "--repeats", "1", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["agents_path"] == "direct"
    # each writer's heads fill whole decode slots: one write per (layer, K/V, page) slice, as the per-slice path
    assert result["ops_staged"] == result["ops_slice"] == LAYERS * 2 * (TOKENS // PAGE) * 2
    assert result["bytes_per_request"] == TOKENS * 2 * LAYERS * HEADS * 64 * 2
    assert len(result["verified"]) == 3, result["verified"]
    assert "direct (agents)" in proc.stdout
