"""Record the runs the GPU connector tests replay: vLLM's real scheduler and kvstage's worker sides on the CPU.

Run from the repository root with vLLM installed: `python tests/integrations/record_traces.py`. Each run is the
connector harness's (`vllm_harness.Pair`) and must end clean (every request served, every block freed once, no
decode request with KV not its prompt's); its steps go to `tests/integrations/traces/NAME.json`
(`worker_replay.Trace`), which `test_vllm_worker_gpu.py` replays over GPU tensors. The recordings are test data,
made again when the connector's scheduler side or vLLM's scheduler changes.
"""

from __future__ import annotations

import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from vllm_harness import Engine, Pair
from worker_replay import TRACES

from kvstage.e2e.model import TinyModelSpec, build_tiny_model
from kvstage.transport.bootstrap import BootstrapServer


@dataclass(frozen=True)
class Run:
    """One recorded run: the TP sizes, the prefill engine's settings, and the prompts' lengths."""

    prefill_tp: int
    decode_tp: int
    lengths: tuple[int, ...]
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    preempts: bool = False


BIG, BUSY = {"num_blocks": 128}, {"num_blocks": 400}
#: prompts of one to three 256-token chunks, prefilled 64 tokens a step
RUNS = {
    "p2d1": Run(2, 1, (100, 300, 600), BIG | {"max_batched_tokens": 64}, BIG),
    "p1d2": Run(1, 2, (100, 300, 600), BIG | {"max_batched_tokens": 64}, BIG),
    "p4d2": Run(4, 2, (100, 300, 600), BIG | {"max_batched_tokens": 64}, BIG),
    # a prefill engine small enough that four concurrent 250-token prompts preempt each other
    "preempt": Run(2, 1, (250,) * 4, {"num_blocks": 20, "max_batched_tokens": 128, "chunk_cap": 32}, preempts=True),
    # 8 requests in every prefill step, chunked (128 tokens of each per step): the host-time measurement
    "busy8": Run(2, 1, (512,) * 8, BUSY | {"max_batched_tokens": 1024, "chunk_cap": 128}, BUSY),
}


def record(name: str, run: Run, model: Path, bootstrap: str) -> None:
    pair = Pair(
        Engine("prefill", "P", run.prefill_tp, model, bootstrap, **run.prefill),
        Engine("decode", "D", run.decode_tp, model, bootstrap, **run.decode),
    )
    try:
        rng = random.Random(name)
        for i, n in enumerate(run.lengths):
            pair.send(f"r{i}", [rng.randrange(3, 500) for _ in range(n)], room=1000 + i)
        pair.run(timeout_s=120)
        assert not pair.corrupt and (pair.prefill.preemptions > 0) == run.preempts, (pair.corrupt, name)
        assert run.preempts or len(pair.intact) == len(run.lengths), (name, pair.intact)
        pair.prefill.assert_clean()
        pair.decode.assert_clean()
        pair.trace().save(TRACES / f"{name}.json")
        print(f"{name}: {len(pair.trace_steps)} steps, {len(pair.intact)} requests intact")
    finally:
        pair.prefill.close()
        pair.decode.close()


def main() -> None:
    TRACES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(TinyModelSpec(num_attention_heads=8, num_kv_heads=4), Path(tmp))
        server = BootstrapServer().start()
        try:
            for name in sys.argv[1:] or list(RUNS):
                record(name, RUNS[name], model, server.address)
        finally:
            server.close()


if __name__ == "__main__":
    main()
