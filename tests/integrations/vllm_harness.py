"""The connector driven the way vLLM drives it, without a model: vLLM's own scheduler, kvstage's real worker sides.

`Engine` is one vLLM engine: vLLM's real `Scheduler` (with `KVStageConnector` built by vLLM's connector factory on
its scheduler side, vLLM's block pool, prefix cache, chunked prefill and preemption), and one `WorkerSide` per TP
rank over a real agent and KV tensors in vLLM's CPU layout. `Engine.step` replays the call order of vLLM's engine
core and model runner: `schedule()`, the step's metadata pickled to every worker, `handle_preemptions`,
`bind_connector_metadata`, the forward (here: each scheduled token's KV written into its block, a value that is a
function of the token and its position only), `wait_for_save`, `get_transfer_results` (aggregated over the ranks
as vLLM's output aggregator does), then `update_from_output` with one sampled token for each request that finished
its prompt. vLLM's scheduler asserts on what a connector reports (a finished id that is not a live request kills a
real engine); the harness adds the checks of issue 21: every block back in the pool, no room shared by two
requests, and decode's blocks hold, for every room that succeeded, exactly the KV of its prompt. Every step is also
recorded (`Pair.trace`, `worker_replay.Step`), so the worker half can be replayed where vLLM is not installed.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from worker_replay import Check, Step, Trace

from kvstage.dataplane.engine_kv import EngineKV, KVCacheFormat
from kvstage.integrations.vllm.metadata import StepRecords
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.integrations.vllm.worker import EngineFacts, WorkerSide
from kvstage.layout import KVLayout, heads_of_rank

BLOCK = 16
LAYERS = 2
HEAD_DIM = 8
EOS = 2


def kv_value(token: int, position: int, layer: int, head: int, is_v: bool) -> torch.Tensor:
    """The KV the 'model' computes: a function of the token and its position only (so prefill and decode agree)."""
    base = (token * 7919 + position * 104729 + layer * 31 + head * 131 + (17 if is_v else 0)) % 65521
    return torch.arange(HEAD_DIM, dtype=torch.float32) + float(base)


@dataclass
class Engine:
    """One vLLM engine (see the module docstring)."""

    role: str  # "prefill" or "decode"
    instance: str
    tp: int
    model: Path
    bootstrap: str
    num_blocks: int = 64
    max_batched_tokens: int = 64
    chunk_cap: int = 0  # vLLM's long_prefill_token_threshold: most tokens of one prompt per step (0: none)
    async_scheduling: bool = False  # schedule step N+1 before step N's output is processed, as vLLM's async mode
    room_timeout_s: float = 20.0
    scheduler: Scheduler = field(init=False)
    workers: list[WorkerSide] = field(init=False)
    kv: list[EngineKV] = field(init=False)
    rooms: dict[int, str] = field(default_factory=dict)  # every room a worker was told of -> its request
    preemptions: int = 0
    reported: Counter[str] = field(default_factory=Counter)  # (finished_sending / recving ids, all ranks)
    answers: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # finished request -> kv_transfer_params
    _pending: Counter[tuple[str, str]] = field(default_factory=Counter)
    _prompts: dict[str, list[int]] = field(default_factory=dict)
    _unprocessed: list[tuple[Any, ModelRunnerOutput]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)  # every step as its workers saw and answered it
    _writes: list[tuple[int, int, int, int]] = field(default_factory=list)  # this step's forward

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        producer = self.role == "prefill"
        extra = {"instance": self.instance, "bootstrap": self.bootstrap, "room_timeout_s": self.room_timeout_s,
                 "dead_after_s": 10.0}  # fmt: skip
        config = VllmConfig(
            model_config=ModelConfig(model=str(self.model), dtype="float32", seed=0),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=self.max_batched_tokens,
                max_model_len=2048,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                long_prefill_token_threshold=self.chunk_cap,
                async_scheduling=self.async_scheduling,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStageConnector",
                kv_connector_module_path="kvstage.integrations.vllm",
                kv_role="kv_producer" if producer else "kv_consumer",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            ),
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp),
        )
        config.cache_config.num_gpu_blocks = self.num_blocks
        heads = config.model_config.get_total_num_kv_heads()
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32)
        kv_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)],
        )
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        settings = ConnectorSettings.from_extra_config(extra)
        layout = KVLayout(LAYERS, heads, HEAD_DIM, "float32", BLOCK)
        self.workers, self.kv = [], []
        for rank in range(self.tp):
            local = len(heads_of_rank(heads, self.tp, rank))
            whole = torch.zeros(LAYERS, self.num_blocks, local, BLOCK, 2 * HEAD_DIM)  # as vLLM: one allocation
            layers = {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}
            worker = WorkerSide(settings, EngineFacts(producer, self.tp, rank, heads, HEAD_DIM, BLOCK))
            worker.register_kv_caches(layers)
            self.workers.append(worker)
            self.kv.append(EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, list(layers.values()), local))

    # ---- requests ---------------------------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = 2) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        sampling.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=sampling,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        request.kv_transfer_params = params
        self._prompts[req_id] = prompt
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    @property
    def live(self) -> set[str]:
        return set(self.scheduler.requests)

    def drain(self) -> None:
        """Async scheduling: hand the scheduler the output of the last step it has not seen yet."""
        while self._unprocessed:
            self._update(*self._unprocessed.pop(0))

    # ---- one step ---------------------------------------------------------------------------------------------

    def step(self) -> set[str]:
        """One engine step; returns the decode requests whose KV arrived intact this step."""
        out = self.scheduler.schedule()
        self.preemptions += len(out.preempted_req_ids or ())
        meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))  # vLLM broadcasts it to every worker
        assert isinstance(meta, StepRecords)
        for expect in meta.expect:
            self._room(expect.room, expect.req_id)
        for compute in meta.compute:
            self._room(compute.room, compute.req_id)
        for worker in self.workers:
            worker.reclaim_preempted(meta)  # vLLM's handle_preemptions, before the forward
            worker.bind(meta)
        self._forward(out)
        for worker in self.workers:
            worker.wait_for_save()
        sending, recving, failed = self._transfer_results()
        received = recving - failed
        self.reported.update(sending | recving)
        self.steps.append(
            Step(self.role, meta, tuple(self._writes), *(tuple(sorted(ids)) for ids in (sending, recving, failed)))
        )
        self._writes.clear()
        sampled = self._sampled(out)
        self._unprocessed.append(
            (
                out,
                ModelRunnerOutput(
                    req_ids=list(out.num_scheduled_tokens),
                    req_id_to_index={r: i for i, r in enumerate(out.num_scheduled_tokens)},
                    sampled_token_ids=[sampled.get(r, []) for r in out.num_scheduled_tokens],
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=None,
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending or None, finished_recving=recving or None, failed_recving=failed
                    ),
                ),
            )
        )
        if not self.async_scheduling or len(self._unprocessed) > 1:  # async: step N's output after N+1 is scheduled
            self._update(*self._unprocessed.pop(0))
        return received

    def _update(self, out: Any, runner_output: ModelRunnerOutput) -> None:
        """vLLM's `update_from_output`; the kv_transfer_params of each request that finished are its answer."""
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.answers[output.request_id] = output.kv_transfer_params

    def _room(self, room: int, req_id: str) -> None:
        owner = self.rooms.setdefault(room, req_id)
        assert owner == req_id, f"room {room} was given to {owner} and to {req_id}"

    def _forward(self, out: Any) -> None:
        """Write the KV of every scheduled token into its block (all ranks, their own heads)."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, start in computed.items():
            request = self.scheduler.requests[req_id]
            tokens = request.all_token_ids
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for pos in range(start, min(start + out.num_scheduled_tokens[req_id], len(tokens))):
                self._write(blocks[pos // BLOCK], pos % BLOCK, tokens[pos], pos)

    def _write(self, block: int, slot: int, token: int, pos: int) -> None:
        self._writes.append((block, slot, token, pos))
        for rank, kv in enumerate(self.kv):
            for local, head in enumerate(heads_of_rank(kv.layout.num_kv_heads, self.tp, rank)):
                for layer in range(LAYERS):
                    kv.k(layer)[block, slot, local] = kv_value(token, pos, layer, head, False)
                    kv.v(layer)[block, slot, local] = kv_value(token, pos, layer, head, True)

    def _sampled(self, out: Any) -> dict[str, list[int]]:
        """A token for each request whose scheduled tokens reach the end of what it holds (prompt done)."""
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            if not request.is_prefill_chunk:  # set by vLLM at schedule(), for the tokens scheduled
                sampled[req_id] = [3 + len(request.output_token_ids)]
        return sampled

    def _transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Each rank's results, aggregated as vLLM's KVOutputAggregator does: an id is finished once every rank
        reported it; a failed load on any rank fails it."""
        done: dict[str, set[str]] = {"sending": set(), "recving": set()}
        failed: set[str] = set()
        for worker in self.workers:
            results = worker.transfer_results()
            failed |= results.failed_recving
            for kind, ids in (("sending", results.finished_sending), ("recving", results.finished_recving)):
                for req_id in ids:
                    self._pending[(kind, req_id)] += 1
                    if self._pending[(kind, req_id)] == self.tp:
                        del self._pending[(kind, req_id)]
                        done[kind].add(req_id)
        return done["sending"], done["recving"], failed & done["recving"]

    # ---- checks -----------------------------------------------------------------------------------------------

    def holds_prompt_kv(self, req_id: str) -> bool:
        """Whether this engine's blocks of `req_id` hold exactly the KV of its prompt, on every rank."""
        prompt = self._prompts[req_id]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        for rank, kv in enumerate(self.kv):
            for local, head in enumerate(heads_of_rank(kv.layout.num_kv_heads, self.tp, rank)):
                for layer in range(LAYERS):
                    for pos, token in enumerate(prompt):
                        got_k = kv.k(layer)[blocks[pos // BLOCK], pos % BLOCK, local]
                        got_v = kv.v(layer)[blocks[pos // BLOCK], pos % BLOCK, local]
                        if not (
                            torch.equal(got_k, kv_value(token, pos, layer, head, False))
                            and torch.equal(got_v, kv_value(token, pos, layer, head, True))
                        ):
                            return False
        return True

    def assert_clean(self) -> None:
        """No request left, every block back in the pool exactly once, every agent quiescent."""
        pool = self.scheduler.kv_cache_manager.block_pool
        assert not self.scheduler.requests, f"{self.instance}: requests left {sorted(self.scheduler.requests)}"
        assert pool.get_num_free_blocks() == self.num_blocks - 1, f"{self.instance}: blocks not all freed"
        assert all(block.ref_cnt == 0 for block in pool.blocks), f"{self.instance}: a block freed twice or never"

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()


@dataclass
class Pair:
    """A prefill and a decode engine and what the router would send them."""

    prefill: Engine
    decode: Engine
    intact: set[str] = field(default_factory=set)  # decode requests whose KV arrived and matched the prompt
    corrupt: set[str] = field(default_factory=set)  # decode requests whose arrived KV did not
    trace_steps: list[Step] = field(default_factory=list)  # both engines' steps, in the order they ran

    def params(self, room: int, to: Engine) -> dict[str, Any]:
        peer = self.decode if to is self.prefill else self.prefill
        return {"kvstage_room": room, "kvstage_peer": peer.instance, "kvstage_peer_tp": peer.tp}

    def send(self, req_id: str, prompt: list[int], room: int, *, decode_max_tokens: int = 3) -> None:
        """What the router does: the prompt to prefill (one token) and to decode, with the same room."""
        self.prefill.add(req_id, prompt, self.params(room, self.prefill), max_tokens=1)
        self.decode.add(req_id, prompt, self.params(room, self.decode), max_tokens=decode_max_tokens)

    def send_sequential(self, req_id: str, prompt: list[int], *, to_decode: bool = True) -> None:
        """What a proxy of vLLM's sequential flow does: the prompt to prefill alone (one token, with
        `do_remote_decode`), then, once prefill answered (and unless `to_decode` is False: the proxy lost
        it), to decode with the answer's kv_transfer_params."""
        ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}  # as vLLM's examples
        self.prefill.add(req_id, prompt, ask, max_tokens=1)
        while req_id not in self.prefill.answers:
            self.prefill.step()
        if to_decode:
            self.decode.add(req_id, prompt, self.prefill.answers[req_id], max_tokens=3)

    def step(self) -> None:
        self.prefill.step()
        self.trace_steps.append(self.prefill.steps[-1])
        checks = []
        for req_id in self.decode.step():
            if self.decode.holds_prompt_kv(req_id):
                self.intact.add(req_id)
                blocks = self.decode.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
                checks.append(Check(req_id, tuple(blocks), tuple(self.decode._prompts[req_id])))
            else:
                self.corrupt.add(req_id)
        self.trace_steps.append(msgspec.structs.replace(self.decode.steps[-1], checks=tuple(checks)))

    def trace(self) -> Trace:
        """The run so far, as the worker half saw it (`worker_replay.Replay` plays it)."""
        return Trace(self.prefill.tp, self.decode.tp, BLOCK, self.prefill.num_blocks, self.decode.num_blocks,
                     tuple(self.trace_steps))  # fmt: skip

    def run(self, until: Iterable[Engine] = (), timeout_s: float = 60.0, extra_steps: int = 0) -> None:
        """Step both engines until neither holds a request (and the agents are quiet), then `extra_steps` more."""
        import time

        deadline = time.monotonic() + timeout_s
        engines = list(until) or [self.prefill, self.decode]
        while any(e.live for e in engines):
            assert time.monotonic() < deadline, f"requests still live: {[sorted(e.live) for e in engines]}"
            self.step()
            time.sleep(0.002)
        for engine in engines:
            engine.drain()
        for _ in range(extra_steps):
            self.step()
