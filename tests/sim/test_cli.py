"""`kvstage sim` as a user runs it: a real subprocess, JSON on the last line, replay with --trace."""

from __future__ import annotations

import json
import subprocess
import sys


def _kvstage(*args: str) -> subprocess.CompletedProcess[str]:
    script = "from kvstage.cli import main; main()"
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)


def test_sim_json_summary_is_the_last_stdout_line() -> None:
    done = _kvstage("sim", "--seeds", "5", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary) >= {
        "seeds",
        "rooms",
        "succeeded",
        "failed",
        "failed_by_reason",
        "violations",
        "events",
        "events_per_second",
    }
    assert summary["seeds"] == 5
    assert summary["rooms"] == summary["succeeded"] + summary["failed"]
    assert summary["failed"] == sum(summary["failed_by_reason"].values())
    assert summary["violations"] == []
    assert summary["events"] > 0 and summary["events_per_second"] > 0


def test_sim_without_faults_succeeds_every_room() -> None:
    done = _kvstage("sim", "--seeds", "5", "--faults", "none", "--no-payloads", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["succeeded"] == summary["rooms"] > 0


def test_sim_trace_replays_one_seed_exactly() -> None:
    first = _kvstage("sim", "--seed", "3", "--faults", "heavy", "--trace", "--json")
    second = _kvstage("sim", "--seed", "3", "--faults", "heavy", "--trace", "--json")
    assert first.returncode == 0, first.stderr + first.stdout
    lines = first.stdout.strip().splitlines()
    assert len(lines) > 100
    # everything but the timing in the JSON summary is identical
    assert lines[:-1] == second.stdout.strip().splitlines()[:-1]
    assert any("digest" in line for line in lines)


def test_sim_rejects_an_unknown_fault_level() -> None:
    done = _kvstage("sim", "--seeds", "1", "--faults", "apocalyptic")
    assert done.returncode != 0
    assert "apocalyptic" in done.stderr + done.stdout
