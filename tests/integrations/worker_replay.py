"""The connector harness's worker half, without vLLM: a recorded run of vLLM's scheduler replayed on real agents.

vLLM's GPU build cannot be installed where the GPU tests run, so the harness (`vllm_harness`, vLLM's real
scheduler on the CPU) records what each engine step handed its workers (`Step`: the step's `StepRecords`, the
tokens its forward wrote into which block slot, and what its workers reported, aggregated over the ranks) into a
`Trace`. `Replay` plays a trace on fresh `WorkerSide`s over real agents, with KV tensors in any of vLLM's layouts
(NHD or HND on a GPU, vLLM's CPU layout on the host) and any dtype, in vLLM's call order: `reclaim_preempted`,
`bind`, the forward (the step's writes, on the engine's stream), `wait_for_save`, `transfer_results`. It keeps the
recorded run's order of events: after each step it polls the workers until they have reported at least what the
recorded step did (earlier reports wait for the step that recorded them), so the scheduler's later decisions,
block reuse after a request was reported sent included, stay valid. It checks, at each step that recorded a decode
request received, that its blocks hold exactly its prompt's KV, byte for byte, and at the end that every report
came exactly once. A report that does not match the recording fails the replay, naming the step.

The KV a token gets is a function of the token, its position, the layer, the head and K/V only (`kv_bytes`), any
bit pattern of the dtype included, so prefill and decode agree and compare as bytes. `Replay(hold_copies=True)`
holds the prefill agents' copy streams around each step that preempts (the reclaim race: the forward must not
overwrite a preempted request's blocks before the gathers queued for them have read them). `StepTimes` keeps the
host time of each worker's hooks per step; `no_host_sync` makes any host wait on the GPU inside them raise.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch

from kvstage.dataplane.engine_kv import EngineKV, KVCacheFormat
from kvstage.dataplane.pool import TORCH_DTYPES
from kvstage.integrations.vllm.metadata import StepRecords
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.integrations.vllm.worker import EngineFacts, WorkerSide
from kvstage.layout import KVLayout, heads_of_rank

TRACES = Path(__file__).with_name("traces")


class Check(msgspec.Struct, frozen=True):
    """A decode request received intact at this step: its blocks and its prompt."""

    req_id: str
    blocks: tuple[int, ...]
    prompt: tuple[int, ...]


class Step(msgspec.Struct, frozen=True):
    """One engine step as vLLM's scheduler made it and the workers answered it (aggregated over the ranks)."""

    engine: str  # "prefill" or "decode"
    meta: StepRecords
    writes: tuple[tuple[int, int, int, int], ...]  # (block, slot, token, position) the forward wrote
    sending: tuple[str, ...]
    recving: tuple[str, ...]
    failed: tuple[str, ...]
    checks: tuple[Check, ...] = ()


class Trace(msgspec.Struct, frozen=True):
    """A recorded run of a prefill and a decode engine, steps in the order they ran."""

    prefill_tp: int
    decode_tp: int
    block_size: int
    prefill_blocks: int
    decode_blocks: int
    steps: tuple[Step, ...]

    def save(self, path: Path) -> None:
        path.write_bytes(msgspec.json.encode(self))

    @classmethod
    def load(cls, path: Path) -> Trace:
        return msgspec.json.decode(path.read_bytes(), type=cls)


def kv_bytes(tokens: torch.Tensor, positions: torch.Tensor, layer: int, heads: torch.Tensor, is_v: bool,
             head_bytes: int) -> torch.Tensor:  # fmt: skip
    """The KV bytes `[n, len(heads), head_bytes]` of tokens at positions (int64, on the KV's device)."""
    base = (tokens * 7919 + positions * 104729 + layer * 31 + (17 if is_v else 0))[:, None] + heads[None, :] * 131
    base = base % 65521
    byte = torch.arange(head_bytes, device=tokens.device, dtype=torch.int64)
    return (((base[..., None] * 2654435761 + byte * 40503) >> 11) & 0xFF).to(torch.uint8)


@dataclass(frozen=True, slots=True)
class Shape:
    """The KV the replay gives each engine: vLLM's layout name ("LBNHC", "LBHNC"; "" for vLLM's CPU layout), the
    device, the cache dtype as vLLM names it ("auto" takes `dtype`; "fp8" stores float8_e4m3fn as uint8)."""

    gpu_layout: str = ""
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    cache_dtype: str = "auto"
    num_layers: int = 2
    num_kv_heads: int = 4
    head_dim: int = 8

    def layer_tensor(self, blocks: int, local_heads: int, block_size: int) -> torch.Tensor:
        """One layer's `[blocks, heads, block_size, 2 * head_dim]` tensor, in memory as vLLM's layout has it."""
        dtype = torch.uint8 if self.cache_dtype.startswith("fp8") else self.dtype
        dims = (blocks, local_heads, block_size, 2 * self.head_dim)
        if self.gpu_layout == "LBNHC":
            return torch.zeros(blocks, block_size, local_heads, 2 * self.head_dim, dtype=dtype, device=self.device
                               ).transpose(1, 2)  # fmt: skip
        return torch.zeros(dims, dtype=dtype, device=self.device)

    def engine_kv(self, layers: list[torch.Tensor], local_heads: int, block_size: int) -> EngineKV:
        """kvstage's own view of one rank's layers, to write and read each token's K and V in any layout."""
        dtype = "float8_e4m3fn" if self.cache_dtype.startswith("fp8") else _dtype_name(self.dtype)
        layout = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, dtype, block_size)
        fmt = {"LBNHC": KVCacheFormat.VLLM_NHD, "LBHNC": KVCacheFormat.VLLM_HND}.get(self.gpu_layout)
        return EngineKV.from_layers(layout, fmt or KVCacheFormat.VLLM_CPU, layers, local_heads)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, candidate in TORCH_DTYPES.items() if candidate == dtype)


@dataclass
class StepTimes:
    """Host seconds of one worker's hooks (reclaim + bind, wait_for_save, transfer_results) per engine step."""

    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)


class _Half:
    """One engine's workers (a WorkerSide per TP rank) over their KV tensors."""

    def __init__(self, role: str, instance: str, tp: int, trace: Trace, shape: Shape, bootstrap: str) -> None:
        self.role, self.tp, self.shape = role, tp, shape
        self.block_size = trace.block_size
        extra = {"instance": instance, "bootstrap": bootstrap, "room_timeout_s": 20.0, "dead_after_s": 10.0,
                 "backend": "cuda_ipc" if shape.device.startswith("cuda") else "local"}  # fmt: skip
        settings = ConnectorSettings.from_extra_config(extra)
        self.workers: list[WorkerSide] = []
        self.kv: list[EngineKV] = []
        for rank in range(tp):
            local = len(heads_of_rank(shape.num_kv_heads, tp, rank))
            blocks = trace.prefill_blocks if role == "prefill" else trace.decode_blocks
            layers = [shape.layer_tensor(blocks, local, self.block_size) for _ in range(shape.num_layers)]
            facts = EngineFacts(role == "prefill", tp, rank, shape.num_kv_heads, shape.head_dim, self.block_size,
                                shape.cache_dtype, shape.gpu_layout)  # fmt: skip
            worker = WorkerSide(settings, facts)
            worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)})
            self.workers.append(worker)
            self.kv.append(shape.engine_kv(layers, local, self.block_size))
        self.reported: Counter[tuple[str, str]] = Counter()  # (kind, request) -> ranks that reported it

    def heads(self, rank: int) -> torch.Tensor:
        return torch.tensor(heads_of_rank(self.shape.num_kv_heads, self.tp, rank), device=self.shape.device)

    def forward(self, writes: tuple[tuple[int, int, int, int], ...]) -> None:
        """The step's KV written into its blocks, every rank its own heads, on the engine's current stream."""
        if not writes:
            return
        block, slot, token, pos = torch.tensor(writes, device=self.shape.device).unbind(1)
        for rank, kv in enumerate(self.kv):
            heads = self.heads(rank)
            for layer in range(kv.layout.num_layers):
                for view, is_v in ((kv.k(layer), False), (kv.v(layer), True)):
                    data = kv_bytes(token, pos, layer, heads, is_v, view.shape[-1] * view.element_size())
                    view[block, slot] = data.view(view.dtype)

    def holds(self, check: Check) -> bool:
        """Whether every rank's blocks of `check.req_id` hold exactly its prompt's KV."""
        positions = torch.arange(len(check.prompt), device=self.shape.device)
        tokens = torch.tensor(check.prompt, device=self.shape.device)
        blocks = torch.tensor(check.blocks, device=self.shape.device)[positions // self.block_size]
        slots = positions % self.block_size
        for rank, kv in enumerate(self.kv):
            heads = self.heads(rank)
            for layer in range(kv.layout.num_layers):
                for view, is_v in ((kv.k(layer), False), (kv.v(layer), True)):
                    got = view[blocks, slots].contiguous().view(torch.uint8)
                    if not torch.equal(got, kv_bytes(tokens, positions, layer, heads, is_v, got.shape[-1])):
                        return False
        return True

    def poll(self) -> None:
        for worker in self.workers:
            results = worker.transfer_results()
            for kind, ids in (("sending", results.finished_sending), ("recving", results.finished_recving),
                              ("failed", results.failed_recving)):  # fmt: skip
                self.reported.update((kind, req_id) for req_id in ids)

    def take(self, step: Step) -> bool:
        """Whether every rank has reported what `step` recorded; if so, those reports are used up."""
        wanted = [("sending", r) for r in step.sending] + [("recving", r) for r in step.recving]
        wanted += [("failed", r) for r in step.failed]
        if any(self.reported[key] < self.tp for key in wanted):
            return False
        for key in wanted:
            self.reported[key] -= self.tp
        self.reported += Counter()  # drop the zeros
        return True

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()


Guard = Callable[[], contextlib.AbstractContextManager[None]]


class Replay:
    """A trace played on a prefill and a decode engine's workers (see the module docstring).

    With `hold_copies`, the prefill agents' copy streams are held shut (`StreamGate`) from the prefill step before
    each step that preempts until that step's forward has been queued: the gathers of the preempted request's last
    chunk then run after the forward that reuses its blocks was queued, as on a backed-up GPU. `held_through`
    counts the preemptions so exercised; a gate is opened early (`opened_early`) only where the recording expects a
    report that needs the held gathers."""

    def __init__(self, trace: Trace, shape: Shape, bootstrap: str, *, hold_copies: bool = False) -> None:
        self.trace = trace
        self.device = shape.device
        self.times = StepTimes()
        self.checked: list[str] = []
        self.held_through = self.opened_early = 0
        self._gate: Any = None  # the StreamGate holding the copy streams, while one does
        prefill_steps = [i for i, step in enumerate(trace.steps) if step.engine == "prefill"]
        self._hold_at = {before for before, at in itertools.pairwise(prefill_steps)
                         if hold_copies and trace.steps[at].meta.preempted}  # fmt: skip
        self.halves: dict[str, _Half] = {}
        self.halves["decode"] = _Half("decode", "D", trace.decode_tp, trace, shape, bootstrap)
        self.halves["prefill"] = _Half("prefill", "P", trace.prefill_tp, trace, shape, bootstrap)

    def run(self, timeout_s: float = 60.0, guard: Guard = contextlib.nullcontext) -> None:
        for index, step in enumerate(self.trace.steps):
            self._step(index, step, timeout_s, guard)
        for half in self.halves.values():
            assert not +half.reported, f"{half.role}: reported beyond the recording: {dict(half.reported)}"
            errors = [dict(worker.errors) for worker in half.workers if worker.errors]
            assert not errors, f"{half.role}: engine records failed inside the workers: {errors}"

    def _step(self, index: int, step: Step, timeout_s: float, guard: Guard) -> None:
        half = self.halves[step.engine]
        if index in self._hold_at:
            self._hold_copies(half)
        spent = [self._timed(guard, partial(_bind, worker, step.meta)) for worker in half.workers]
        half.forward(step.writes)
        if step.meta.preempted and self._gate is not None:
            self.held_through += 1
            self._open()
        for rank, worker in enumerate(half.workers):
            spent[rank] += self._timed(guard, worker.wait_for_save)
        spent[0] += self._timed(guard, half.poll)  # one poll per step is the hook's cost
        deadline = time.monotonic() + timeout_s
        while not half.take(step):
            if self._gate is not None:
                self.opened_early += 1
                self._open()
            assert time.monotonic() < deadline, f"step {index} ({step.engine}): reports {step} not seen in time"
            time.sleep(0.0005)
            half.poll()
        getattr(self.times, step.engine).append(spent[0])
        for check in step.checks:
            assert half.holds(check), f"step {index}: decode request {check.req_id} holds KV not its prompt's"
            self.checked.append(check.req_id)

    @staticmethod
    def _timed(guard: Guard, call: Callable[[], object]) -> float:
        started = time.perf_counter()
        with guard():
            call()
        return time.perf_counter() - started

    def _hold_copies(self, half: _Half) -> None:
        from gpu_gate import StreamGate  # GPU only (tests/gpu_gate.py; imports Triton)

        self._gate = StreamGate(self.device)
        for worker in half.workers:
            assert worker.agent is not None and worker.agent.device_work.stream is not None
            self._gate.hold(worker.agent.device_work.stream)

    def _open(self) -> None:
        assert self._gate is not None
        self._gate.release()
        self._gate = None

    def close(self) -> None:
        if self._gate is not None:
            self._open()
        for half in self.halves.values():
            half.close()


def _bind(worker: WorkerSide, meta: StepRecords) -> None:
    """vLLM's `handle_preemptions` then `bind_connector_metadata`, before the forward."""
    worker.reclaim_preempted(meta)
    worker.bind(meta)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, on this thread, any host wait on the GPU raises: `torch.cuda.synchronize`, a stream's or an event's
    `synchronize`, and reading a CUDA tensor on the host (`item`, `tolist`, `cpu`)."""
    thread = threading.get_ident()
    saved: list[tuple[object, str, object]] = []

    def forbid(owner: object, name: str, cuda_tensor_only: bool = False) -> None:
        original = getattr(owner, name)

        def guarded(*args: object, **kwargs: object) -> object:
            tensor = args[0] if args else None
            applies = not cuda_tensor_only or (isinstance(tensor, torch.Tensor) and tensor.is_cuda)
            if applies and threading.get_ident() == thread:
                raise AssertionError(f"host wait on the GPU on the engine's step path: {name}")
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, guarded)

    forbid(torch.cuda, "synchronize")
    forbid(torch.cuda.Stream, "synchronize")
    forbid(torch.cuda.Event, "synchronize")
    for name in ("item", "tolist", "cpu"):
        forbid(torch.Tensor, name, cuda_tensor_only=True)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
