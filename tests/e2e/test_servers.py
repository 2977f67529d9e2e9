"""How the end-to-end runs start vLLM, and what they report about a hung engine (kvstage.e2e.servers)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from kvstage.e2e.servers import VLLMServerSpec, main_thread_scheduling


@pytest.mark.parametrize("tp", [1, 2])
def test_no_vllm_worker_of_a_test_server_is_bound_to_a_core(tp: int) -> None:
    """A worker bound to one core of the shared 2-core host waited 107 s to run there while other processes ran on
    it, and its TP peer spun in vLLM's all-reduce: the engine hung (docs/deploy.md). Unbound, the kernel moves it."""
    env = VLLMServerSpec("prefill", "P", tp, 8100, Path("model"), "tcp://127.0.0.1:7100").env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1"


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux's schedstat")
def test_a_hung_engine_report_names_each_process_state_cpus_and_time_waited_to_run() -> None:
    cpu = min(os.sched_getaffinity(0))
    with subprocess.Popen(["taskset", "-c", str(cpu), "sleep", "30"]) as child:
        try:
            comm = Path(f"/proc/{child.pid}/comm")
            deadline = time.monotonic() + 10.0
            while comm.read_text().strip() != "sleep":  # taskset binds itself, then runs sleep in its place
                assert time.monotonic() < deadline, "taskset did not start sleep within 10 s"
                time.sleep(0.01)
            line = main_thread_scheduling(str(child.pid))
        finally:
            child.kill()
    assert line.startswith(f"{child.pid} ")
    assert f"CPUs {cpu}," in line
    assert "state " in line and " ran " in line and "waited to run " in line


def test_a_hung_engine_report_says_when_a_process_is_gone() -> None:
    with subprocess.Popen(["true"]) as child:
        child.wait()
    assert main_thread_scheduling(str(child.pid)).startswith(f"{child.pid}: not readable")
