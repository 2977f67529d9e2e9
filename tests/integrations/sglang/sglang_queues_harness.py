"""sglang 0.5.23's real disaggregation queues on CPU, one object per rank, with the kvstage transfer backend.

Each rank gets its own sglang runtime context (`create_context` from a real `ServerArgs`, rank placement from
`SpawnRanks`), entered with `use_context` around every call into sglang, so several ranks of both instances live
in one test process. Real sglang objects per rank: `MHATokenToKVPool` (bf16, CPU), `PagedTokenToKVPoolAllocator`,
`ReqToTokenPool` / `DecodeReqToTokenPool`, `RadixCache` (disabled, or on decode enabled as with
`--disaggregation-decode-enable-radix-cache`),
`MetadataBuffers`, `ReqToMetadataIdxAllocator`, `PrefillBootstrapQueue`, `DecodePreallocQueue`,
`DecodeTransferQueue`, and the scheduler's prefill mixin (`SchedulerDisaggregationPrefillMixin`: `send_kv_chunk`,
`process_disagg_prefill_inflight_queue`). The stand-ins are listed in test_sglang_queues.py's docstring.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

LAYERS, HEADS, DIM, PAGE = 2, 4, 8, 4
POOL_TOKENS, REQ_ROWS, META_ROWS, CONTEXT_LEN = 512, 8, 8, 256


def init_world() -> None:
    """sglang all-reduces poll states over its TP CPU group; one process here, so a gloo world of one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def tp_groups(size: int) -> list[Any]:
    """A real gloo group of `size` ranks in this process, one `ProcessGroupGloo` per rank (each made on a thread of
    its own: making one waits for all). sglang MIN-reduces poll states over such a group; its collectives then need
    every rank's call at once, from threads of their own (`run_queues_tp`)."""
    import torch.distributed as dist

    store, groups = dist.PrefixStore(f"tp{next(_groups)}", dist.HashStore()), [None] * size

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, size, timeout=timedelta(seconds=30))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups), "gloo group not made"
    return groups


_groups = itertools.count()


class _Streamer:
    """Stand-in for the scheduler's output streamer (it talks to the tokenizer process): records what is sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def stream_output(self, reqs: list[Any], *args: Any, **kwargs: Any) -> None:
        self.sent.extend(reqs)


MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "vocab_size": 256,
                "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": HEADS, "head_dim": DIM,
                "num_hidden_layers": LAYERS, "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}  # fmt: skip


def write_model(directory: Path) -> str:
    """A model directory with only an HF config (no weights, no tokenizer): what sglang's `ModelConfig` reads."""
    (directory / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(directory)


def _scheduler_fields(server_args: Any, tp: int, pool: Any, allocator: Any, req_pool: Any, tree: Any,
                      tp_group: Any) -> dict:  # fmt: skip
    """What the queues read of sglang's `Scheduler` (its model config is sglang's real `ModelConfig`; `tp_group`
    is the attention-TP gloo group prefill's queues MIN-reduce poll states over, None: the world of one)."""
    from sglang.srt.runtime_context import process_model_config
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    model_config = process_model_config()
    runner = SimpleNamespace(kv_cache_dtype_str="bfloat16", effective_logical_max_total_num_tokens=POOL_TOKENS,
                             swa_max_total_num_tokens=POOL_TOKENS)  # fmt: skip
    return dict(
        server_args=server_args, tp_size=tp, model_config=model_config, rust_server=None, kv_shard_widening=1,
        tp_worker=SimpleNamespace(model_runner=runner, is_hybrid_swa=False), token_to_kv_pool_allocator=allocator,
        req_to_token_pool=req_pool, tree_cache=tree, attn_cp_cpu_group=None, attn_tp_cpu_group=tp_group,
        output_streamer=_Streamer(), metrics_reporter=SimpleNamespace(enable_metrics=False),
        enable_overlap=False, enable_staging=False, enable_hisparse=False, enable_lora=False,
        enable_decode_hicache=False, enable_priority_scheduling=False, random_seed=0, waiting_queue=[],
        running_batch=SimpleNamespace(reqs=[]), spec_algorithm=SpeculativeAlgorithm.NONE,
        disagg_prefill_pending_chunk_rids=set(), disagg_prefill_inflight_queue=[], chunked_req=None,
        kv_checksum_computer=None, disagg_decode_prealloc_queue=None, processed_tokens_counter=0,
        scheduler_stage_metrics=None, last_batch=None, sliding_window_size=None,
        batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None),
    )  # fmt: skip


def _mixin() -> type:
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    class PrefillScheduler(SchedulerDisaggregationPrefillMixin):  # type: ignore[misc]
        """Stand-in for sglang's `Scheduler` on a prefill rank: sglang's own prefill mixin methods, over the
        fields the queues read (a real `Scheduler` loads a model and needs a GPU)."""

        def __init__(self, fields: dict) -> None:
            self.__dict__.update(fields)
            self.aborted: list[Any] = []

        def _release_aborted_request(self, req: Any) -> None:  # Scheduler's: frees what an aborted req holds
            self.aborted.append(req)

    return PrefillScheduler


class Rank:
    """One sglang scheduler process's disaggregation state (prefill or decode), with its own runtime context."""

    def __init__(self, model: str, mode: str, tp: int, rank: int, port: int, tp_group: Any = None,
                 **server_fields: Any) -> None:  # fmt: skip
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.runtime_context import SpawnRanks, create_context
        from sglang.srt.server_args import ServerArgs

        self.mode, self.tp, self.rank = mode, tp, rank
        self.server_args = ServerArgs(model_path=model, disaggregation_mode=mode, tp_size=tp, device="cpu",
                                      disaggregation_transfer_backend="kvstage", disaggregation_bootstrap_port=port,
                                      skip_tokenizer_init=True, page_size=PAGE, **server_fields)  # fmt: skip
        self.ctx = create_context(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None))
        # Stand-in for sglang's attention-TP GroupCoordinator: only its gloo group is read (`tp_group`, a real gloo
        # group of the instance's ranks, or None: the world of one). Decode's queues read it from the context,
        # prefill's from the scheduler's `attn_tp_cpu_group` (below).
        self.ctx.parallel.override_permanently(attn_tp_group=SimpleNamespace(cpu_group=tp_group))
        with self.context():
            heads = HEADS // tp
            self.pool = MHATokenToKVPool(size=POOL_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=heads,
                                         head_dim=DIM, layer_num=LAYERS, device="cpu",
                                         enable_memory_saver=False)  # fmt: skip
            self.allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.bfloat16, "cpu", self.pool, False)
            if mode == "prefill":
                self.req_pool: Any = ReqToTokenPool(REQ_ROWS, CONTEXT_LEN, "cpu", False)
            else:
                from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

                self.req_pool = DecodeReqToTokenPool(REQ_ROWS, CONTEXT_LEN, "cpu", False, pre_alloc_size=REQ_ROWS)
            radix = bool(server_fields.get("disaggregation_decode_enable_radix_cache"))  # decode only
            params = CacheInitParams(disable=not radix, req_to_token_pool=self.req_pool,
                                     token_to_kv_pool_allocator=self.allocator, page_size=PAGE)  # fmt: skip
            self.tree = RadixCache(params)
            self.meta = MetadataBuffers(META_ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16,
                                        max_sampling_mask_tokens=16)  # fmt: skip
            self.meta_alloc = ReqToMetadataIdxAllocator(META_ROWS)
            fields = _scheduler_fields(self.server_args, tp, self.pool, self.allocator, self.req_pool, self.tree,
                                       tp_group)  # fmt: skip
            fields.update(disagg_metadata_buffers=self.meta, req_to_metadata_buffer_idx_allocator=self.meta_alloc)
            backend = TransferBackend("kvstage")
            if mode == "prefill":
                from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

                self.sched: Any = _mixin()(fields)
                self.bootstrap = PrefillBootstrapQueue(
                    token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                    req_to_metadata_buffer_idx_allocator=self.meta_alloc, metadata_buffers=self.meta, gpu_id=0,
                    bootstrap_port=port, max_total_num_tokens=POOL_TOKENS, scheduler=self.sched,
                    scheduler_stage_metrics=None, transfer_backend=backend,
                )  # fmt: skip
                self.sched.disagg_prefill_bootstrap_queue = self.bootstrap
                self.kv_manager = self.bootstrap.kv_manager
            else:
                from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

                self.sched = SimpleNamespace(**fields)
                self.transfer = DecodeTransferQueue(self.meta_alloc, self.meta, self.sched, self.tree)
                self.prealloc = DecodePreallocQueue(
                    req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator,
                    draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=self.meta_alloc,
                    metadata_buffers=self.meta, scheduler=self.sched, transfer_queue=self.transfer,
                    tree_cache=self.tree, gpu_id=0, bootstrap_port=port, max_total_num_tokens=POOL_TOKENS,
                    num_reserved_decode_tokens=0, transfer_backend=backend,
                )  # fmt: skip
                self.sched.disagg_decode_prealloc_queue = self.prealloc
                self.kv_manager = self.prealloc.kv_manager

    @contextmanager
    def context(self) -> Iterator[None]:
        from sglang.srt.runtime_context import use_context

        with use_context(self.ctx):
            yield

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.context():
            return fn(*args, **kwargs)

    @property
    def agent(self) -> Any:
        return self.kv_manager.backend.agent

    def close(self) -> None:
        self.kv_manager.close()


def wait(predicate: Callable[[], Any], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


_ports = itertools.count(19410)


class Cluster:
    """A prefill instance of `p_tp` ranks, a decode instance of `d_tp`, sglang's mailbox and kvstage's directory.
    `prefill_groups` / `decode_groups`: one real gloo group per rank of that instance (`tp_groups`), else each rank
    sees a world of one; `decode_fields`: more `ServerArgs` fields for decode (its radix cache)."""

    def __init__(self, model: str, p_tp: int, d_tp: int, monkeypatch: Any, timeout_s: float,
                 prefill_groups: list[Any] | None = None, decode_groups: list[Any] | None = None,
                 **decode_fields: Any) -> None:  # fmt: skip
        from kvstage.integrations.sglang.conn import KVStageBootstrapServer
        from kvstage.transport.bootstrap import BootstrapServer

        self.port = next(_ports)
        self.directory = BootstrapServer().start()
        for k, v in dict(KVSTAGE_BOOTSTRAP=self.directory.address, KVSTAGE_CHUNK_TOKENS="8", KVSTAGE_RING_MIB="1",
                         KVSTAGE_STAGING_MIB="1", KVSTAGE_ROOM_TIMEOUT_S=str(timeout_s)).items():  # fmt: skip
            monkeypatch.setenv(k, v)
        self.mailbox = KVStageBootstrapServer("127.0.0.1", self.port)  # sglang starts it on the prefill instance
        monkeypatch.setenv("KVSTAGE_INSTANCE", f"q-prefill-{self.port}")
        self.prefill_shares_group = prefill_groups is not None
        p_groups = prefill_groups or [None] * p_tp
        self.prefill = [Rank(model, "prefill", p_tp, r, self.port, p_groups[r]) for r in range(p_tp)]
        monkeypatch.setenv("KVSTAGE_INSTANCE", f"q-decode-{self.port}")
        self.decode_shares_group = decode_groups is not None
        groups = decode_groups or [None] * d_tp
        self.decode = [Rank(model, "decode", d_tp, r, self.port, groups[r], **decode_fields) for r in range(d_tp)]

    def close(self) -> None:
        for r in self.prefill + self.decode:
            r.close()
        self.mailbox.close()
        self.directory.close()


def new_req(rid: str, tokens: int, room: Any, port: int) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = array("q", [(7 * i + 3) % 200 for i in range(tokens)])
    return Req(rid, "", ids, SamplingParams(max_new_tokens=8), bootstrap_host="127.0.0.1", bootstrap_port=port,
               bootstrap_room=room)  # fmt: skip


def slots_of(rank: Rank, req: Any, tokens: int) -> torch.Tensor:
    return rank.req_pool.req_to_token[req.kv.req_pool_idx, :tokens].to(torch.int64)


def forward(rank: Rank, req: Any, truth: torch.Tensor) -> None:
    """Stand-in for the model forward of the whole prompt: row and pages from sglang's allocators, KV written."""
    tokens = truth.shape[2]
    rank.req_pool.alloc([req])
    pages = -(-tokens // PAGE)
    loc = rank.allocator.alloc(pages * PAGE)
    rank.req_pool.write((req.kv.req_pool_idx, slice(0, tokens)), loc[:tokens].to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = tokens
    heads = range(rank.rank * rank.pool.head_num, (rank.rank + 1) * rank.pool.head_num)
    slots = slots_of(rank, req, tokens)
    for layer in range(LAYERS):
        rank.pool.k_buffer[layer][slots] = truth[0, layer][:, heads.start : heads.stop]
        rank.pool.v_buffer[layer][slots] = truth[1, layer][:, heads.start : heads.stop]


def prefill_request(rank: Rank, req: Any, truth: torch.Tensor, chunk_tokens: int, first_token: int) -> None:
    """One prefill rank's life of `req`: bootstrap queue, chunked prefill sends, inflight queue."""
    rank.call(rank.bootstrap.add, req, rank.pool.head_num)
    popped = rank.call(rank.bootstrap.pop_bootstrapped)
    assert popped == [req], "kvstage's sender must let prefill start at once (WaitingForInput)"
    prefill_sends(rank, req, truth, chunk_tokens, first_token)


def prefill_sends(rank: Rank, req: Any, truth: torch.Tensor, chunk_tokens: int, first_token: int,
                  last: bool = True) -> None:  # fmt: skip
    """A bootstrapped `req` on one prefill rank: forward, chunked prefill sends, into the inflight queue, and its
    last chunk sent (unless `last` is False: the test sends it later, `send_last`)."""
    tokens = truth.shape[2]
    forward(rank, req, truth)
    for end in range(chunk_tokens, tokens, chunk_tokens):  # process_prefill_chunk: one send per middle chunk
        req.extend_end = end
        rank.call(rank.sched.send_kv_chunk, req)
    req.extend_end = tokens  # process_batch_result_disagg_prefill, last chunk
    req.output_ids.append(first_token)
    rank.sched.disagg_prefill_inflight_queue.append(req)
    if last:
        send_last(rank, req)


def send_last(rank: Rank, req: Any) -> None:
    """The send of `req`'s last chunk (with its aux row), as process_batch_result_disagg_prefill does."""
    rank.call(rank.sched.send_kv_chunk, req, last_chunk=True)


def run_queues(c: Cluster, until: Any, timeout_s: float = 30) -> dict[str, list[Any]]:
    """Turn every rank's queues, as their event loops do, until `until(done)`."""
    done: dict[str, list[Any]] = {"prefill": [], "decode": [], "decode_failed": []}

    def turn() -> bool:
        for r in c.prefill:
            done["prefill"] += r.call(r.sched.process_disagg_prefill_inflight_queue)
        for r in c.decode:
            ready, failed = r.call(r.prealloc.pop_preallocated)
            r.call(r.transfer.extend, ready)
            done["decode_failed"] += failed
            done["decode"] += r.call(r.transfer.pop_transferred)
        return bool(until(done))

    wait(turn, timeout_s)
    return done


def decode_kv(c: Cluster, reqs: list[Any], tokens: int) -> torch.Tensor:
    """What decode holds for the request, `[2, layers, tokens, heads, dim]`, the heads of every rank joined."""
    per_rank = []
    for r, req in zip(c.decode, reqs, strict=True):
        slots = slots_of(r, req, tokens)
        per_rank.append(torch.stack([torch.stack([r.pool.k_buffer[i][slots] for i in range(LAYERS)]),
                                     torch.stack([r.pool.v_buffer[i][slots] for i in range(LAYERS)])]))  # fmt: skip
    return torch.cat(per_rank, dim=3)


def ring_empty(c: Cluster) -> None:
    for r in c.decode:
        wait(lambda a=r.agent: a.wait_quiescent(0.05) and a.snapshot().ring_live_bytes == 0)


def handoff(c: Cluster, room: int, tokens: int, chunk_tokens: int) -> tuple[list[Any], list[Any], torch.Tensor]:
    """A request through both instances' queues; returns prefill's and decode's `Req` of every rank and the KV."""
    truth = torch.randn(2, LAYERS, tokens, HEADS, DIM).to(torch.bfloat16)
    d_reqs = [new_req(f"r{room}", tokens, room, c.port) for _ in c.decode]
    for r, req in zip(c.decode, d_reqs, strict=True):
        r.call(r.prealloc.add, req)
    p_reqs = [new_req(f"r{room}", tokens, room, c.port) for _ in c.prefill]
    for r, req in zip(c.prefill, p_reqs, strict=True):
        prefill_request(r, req, truth, chunk_tokens, first_token=4242)
    return p_reqs, d_reqs, truth


def abort_message(req: Any) -> str:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    assert isinstance(req.finished_reason, FINISH_ABORT), req.finished_reason
    return str(req.finished_reason.message)


def on_threads(ranks: list[Rank], fn: Callable[[Rank], Any]) -> list[Any]:
    """`fn(rank)` for every rank of an instance at once, each on a thread of its own (the collectives over their
    shared gloo group need all ranks' calls at once), all under the instance's rank 0's runtime context (sglang's
    context is one per process; the ranks' contexts differ only in rank numbers, which the queues read when they
    are built, and in what sglang logs)."""
    with ranks[0].context(), ThreadPoolExecutor(len(ranks)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn, r) for r in ranks]]


def run_queues_tp(c: Cluster, until: Any, timeout_s: float = 30) -> dict[str, list[Any]]:
    """`run_queues` where an instance's ranks share a real gloo group (`tp_groups`): each turn, that instance's ranks
    turn their queues at once (`on_threads`); an instance without one turns them one rank after another.
    `done["prefill_turns"]` / `done["turns"]` have, per turn, each prefill / decode rank's requests that left its
    inflight / transfer queue."""
    done: dict[str, list[Any]] = {"prefill": [], "decode": [], "decode_failed": [], "prefill_turns": [], "turns": []}

    def prefill_turn(r: Rank) -> list[Any]:
        return list(r.sched.process_disagg_prefill_inflight_queue())

    def decode_turn(r: Rank) -> tuple[list[Any], list[Any]]:
        ready, failed = r.prealloc.pop_preallocated()
        r.transfer.extend(ready)
        return failed, r.transfer.pop_transferred()

    def each(ranks: list[Rank], fn: Callable[[Rank], Any], together: bool) -> list[Any]:
        return on_threads(ranks, fn) if together else [r.call(fn, r) for r in ranks]

    def turn() -> bool:
        popped = each(c.prefill, prefill_turn, c.prefill_shares_group)
        done["prefill_turns"].append(popped)
        done["prefill"] += [req for reqs in popped for req in reqs]
        results = each(c.decode, decode_turn, c.decode_shares_group)
        done["turns"].append([popped for _, popped in results])
        for failed, popped in results:
            done["decode_failed"] += failed
            done["decode"] += popped
        return bool(until(done))

    wait(turn, timeout_s)
    return done
