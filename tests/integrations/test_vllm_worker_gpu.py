"""The connector's worker half on a GPU: recorded runs of vLLM's own scheduler (`record_traces.py`) replayed on
worker sides whose KV is GPU tensors in vLLM's NHD and HND layouts, bf16 and fp8, staged in device memory over
cuda_ipc; every decode request gets exactly its prompt's KV, byte for byte, including while prefill preempts with
its copy streams held; and no hook of the engine's step makes the host wait for the GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from worker_replay import TRACES, Replay, Shape, Trace, no_host_sync

from kvstage.integrations.vllm.worker import WorkerSide
from kvstage.transport.bootstrap import BootstrapServer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYOUTS = {"nhd": "LBNHC", "hnd": "LBHNC"}
DTYPES = {"bf16": "auto", "fp8": "fp8"}


def gpu_shape(layout: str, dtype: str) -> Shape:
    return Shape(LAYOUTS[layout], "cuda", torch.bfloat16, DTYPES[dtype], num_layers=4, num_kv_heads=8, head_dim=128)


@pytest.fixture
def bootstrap() -> Iterator[str]:
    server = BootstrapServer().start()
    yield server.address
    server.close()


def replay(name: str, shape: Shape, bootstrap: str, **options: bool) -> Replay:
    trace = Trace.load(TRACES / f"{name}.json")
    played = Replay(trace, shape, bootstrap, **options)
    try:
        played.run(guard=no_host_sync)
    finally:
        played.close()
    assert sorted(played.checked) == sorted(c.req_id for step in trace.steps for c in step.checks)
    assert played.checked
    return played


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["p2d1", "p1d2", "p4d2"])
def test_vllms_gpu_kv_hands_off_bit_exact_staged_in_device_memory(bootstrap: str, name: str, layout: str,
                                                                   dtype: str) -> None:  # fmt: skip
    replay(name, gpu_shape(layout, dtype), bootstrap)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_prefill_preemption_with_the_copy_streams_held_gives_no_request_wrong_kv(bootstrap: str, layout: str) -> None:
    played = replay("preempt", gpu_shape(layout, "bf16"), bootstrap, hold_copies=True)
    assert played.held_through > 0, "no preemption ran with the gathers still held"


def test_a_host_wait_added_on_the_step_path_fails_the_replay(bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = WorkerSide.wait_for_save

    def waits(self: WorkerSide) -> None:
        original(self)
        torch.cuda.current_stream().synchronize()

    monkeypatch.setattr(WorkerSide, "wait_for_save", waits)
    with pytest.raises(AssertionError, match="host wait on the GPU on the engine's step path"):
        replay("p2d1", gpu_shape("nhd", "bf16"), bootstrap)
