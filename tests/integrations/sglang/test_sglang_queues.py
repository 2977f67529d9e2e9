"""sglang 0.5.23's real disaggregation queues, driven on CPU with the kvstage transfer backend over real kvstage
agents (local backend), and what lands checked bit for bit (bf16 compared as integers).

Real sglang, per rank (sglang_queues_harness.py): `ServerArgs` with `--disaggregation-transfer-backend kvstage`
(the plugin loaded by `load_plugins()`), a runtime context of its own (`create_context` + `SpawnRanks`, entered with
`use_context`, so prefill TP 2 and decode TP 1 live in one process), `ModelConfig` from a config-only model
directory, `MHATokenToKVPool` (bf16, CPU), `PagedTokenToKVPoolAllocator`, `ReqToTokenPool` /
`DecodeReqToTokenPool`, `RadixCache` (disabled, as `--disable-radix-cache`), `MetadataBuffers`,
`ReqToMetadataIdxAllocator`, `Req` and `SamplingParams`. Prefill: `PrefillBootstrapQueue` (`add`,
`pop_bootstrapped`, its `_init_kv_manager` building kvstage's manager from the pool), the scheduler's prefill mixin
(`send_kv_chunk` / `_send_kv_chunk`: page indices from `req_to_token`, the aux row from `MetadataBuffers.set_buf`;
`process_disagg_prefill_inflight_queue`: polls, releases the KV, streams). Decode: `DecodePreallocQueue` (`add`,
`pop_preallocated`: receiver, prefill info, allocation, `send_metadata`) and `DecodeTransferQueue`
(`pop_transferred`: metadata gate, commit, release on failure).

Stand-ins, and why:
- the `Scheduler` object: a real one loads a model and builds NCCL/gloo groups on a GPU. Prefill's is a class
  that inherits sglang's real `SchedulerDisaggregationPrefillMixin` over the fields its methods read; decode's
  is a namespace of the fields the decode queues read (`tp_worker.model_runner.kv_cache_dtype_str`, the output
  streamer, metrics switches, an empty running batch). The output streamer records what it is given (it would
  talk to the tokenizer process); `_release_aborted_request` records the request.
- the forward pass: the test allocates the request's row and pages through sglang's real `ReqToTokenPool.alloc`
  and `PagedTokenToKVPoolAllocator.alloc`, writes random bf16 KV into the real pool, and then does what
  `process_prefill_chunk` (middle chunks: `send_kv_chunk(req)`) and `process_batch_result_disagg_prefill` (last
  chunk: first token appended, onto the inflight queue, `send_kv_chunk(req, last_chunk=True)`) do; those two
  need a `ScheduleBatch` and a model's `GenerationBatchResult`.
- process groups: sglang MIN-reduces poll states across the TP ranks of an instance over gloo. The ranks share a
  process here, so a gloo world of one is initialised and the attention-TP `GroupCoordinator` is a namespace
  whose `cpu_group` is that world: each rank's queues see their own rank's poll, not the TP minimum.
"""

from __future__ import annotations

import itertools
from array import array
from typing import Any

import pytest
import torch
from sglang_queues_harness import DIM, HEADS, LAYERS, PAGE, Rank, init_world, wait, write_model

_ports = itertools.count(19410)


class Cluster:
    def __init__(self, model: str, p_tp: int, d_tp: int, monkeypatch: pytest.MonkeyPatch, timeout_s: float) -> None:
        from kvstage.integrations.sglang.conn import KVStageBootstrapServer
        from kvstage.transport.bootstrap import BootstrapServer

        self.port = next(_ports)
        self.directory = BootstrapServer().start()
        for k, v in dict(KVSTAGE_BOOTSTRAP=self.directory.address, KVSTAGE_CHUNK_TOKENS="8", KVSTAGE_RING_MIB="1",
                         KVSTAGE_STAGING_MIB="1", KVSTAGE_ROOM_TIMEOUT_S=str(timeout_s)).items():  # fmt: skip
            monkeypatch.setenv(k, v)
        self.mailbox = KVStageBootstrapServer("127.0.0.1", self.port)  # sglang starts it on the prefill instance
        monkeypatch.setenv("KVSTAGE_INSTANCE", f"q-prefill-{self.port}")
        self.prefill = [Rank(model, "prefill", p_tp, r, self.port) for r in range(p_tp)]
        monkeypatch.setenv("KVSTAGE_INSTANCE", f"q-decode-{self.port}")
        self.decode = [Rank(model, "decode", d_tp, r, self.port) for r in range(d_tp)]

    def close(self) -> None:
        for r in self.prefill + self.decode:
            r.close()
        self.mailbox.close()
        self.directory.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every sglang process does: registers the kvstage backend
    init_world()
    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def cluster_of(model: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[Cluster] = []

    def make(p_tp: int, d_tp: int, timeout_s: float = 20) -> Cluster:
        made.append(Cluster(model, p_tp, d_tp, monkeypatch, timeout_s))
        return made[-1]

    yield make
    for c in made:
        c.close()


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
    tokens = truth.shape[2]
    rank.call(rank.bootstrap.add, req, rank.pool.head_num)
    popped = rank.call(rank.bootstrap.pop_bootstrapped)
    assert popped == [req], "kvstage's sender must let prefill start at once (WaitingForInput)"
    forward(rank, req, truth)
    for end in range(chunk_tokens, tokens, chunk_tokens):  # process_prefill_chunk: one send per middle chunk
        req.extend_end = end
        rank.call(rank.sched.send_kv_chunk, req)
    req.extend_end = tokens  # process_batch_result_disagg_prefill, last chunk
    req.output_ids.append(first_token)
    rank.sched.disagg_prefill_inflight_queue.append(req)
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


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize(("tokens", "chunk_tokens"), [(30, 64), (37, 8), (45, 12)])
def test_real_queues_land_kv_bit_exact(cluster_of: Any, p_tp: int, d_tp: int, tokens: int,
                                       chunk_tokens: int) -> None:  # fmt: skip
    c = cluster_of(p_tp, d_tp)
    _, d_reqs, truth = handoff(c, 501, tokens, chunk_tokens)
    done = run_queues(c, lambda d: len(d["prefill"]) == p_tp and len(d["decode"]) == d_tp)
    assert done["decode_failed"] == []
    got = decode_kv(c, d_reqs, tokens)
    assert torch.equal(got.view(torch.int16), truth.view(torch.int16))
    for req in d_reqs:  # the aux row landed: decode's Req took prefill's first token from it
        assert list(req.output_ids) == [4242], req.output_ids
    ring_empty(c)


def abort_message(req: Any) -> str:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    assert isinstance(req.finished_reason, FINISH_ABORT), req.finished_reason
    return str(req.finished_reason.message)


@pytest.mark.parametrize("room", [0, None])
def test_malformed_room_is_aborted_by_both_queues(cluster_of: Any, room: Any) -> None:
    """Room 0 (sglang's "no metadata yet" marker) and no room at all: the bootstrap queue and the prealloc queue
    each abort the request with kvstage's reason, and nothing is allocated for it."""
    c = cluster_of(1, 1)
    p, d = c.prefill[0], c.decode[0]
    p_req, d_req = new_req("bad", 30, room, c.port), new_req("bad", 30, room, c.port)
    free_meta = p.meta_alloc.available_size()
    p.call(p.bootstrap.add, p_req, p.pool.head_num)
    assert p.call(p.bootstrap.pop_bootstrapped) == [] and p.bootstrap.queue == []
    assert "malformed room" in abort_message(p_req) and p.sched.output_streamer.sent == [p_req]
    assert p.meta_alloc.available_size() == free_meta
    d.call(d.prealloc.add, d_req)
    done = run_queues(c, lambda x: x["decode_failed"])
    assert [x.req for x in done["decode_failed"]] == [d_req] and "malformed room" in abort_message(d_req)
    assert d.prealloc.queue == [] and d.transfer.queue == [] and d_req.kv.req_pool_idx is None


def test_decode_abort_ends_both_sides_failed_and_frees_the_ring(cluster_of: Any) -> None:
    """Decode aborts a request in its transfer queue (the receiver's `abort`, as sglang's abort path calls it):
    the transfer queue releases it with kvstage's reason, prefill's inflight queue ends it failed."""
    c = cluster_of(1, 1)
    d = c.decode[0]
    d_req = new_req("r601", 64, 601, c.port)
    d.call(d.prealloc.add, d_req)
    wait(lambda: (d.call(d.transfer.extend, d.call(d.prealloc.pop_preallocated)[0]), d.transfer.queue)[1])
    d.transfer.queue[0].kv_receiver.abort()
    truth = torch.randn(2, LAYERS, 64, HEADS, DIM).to(torch.bfloat16)
    p_req = new_req("r601", 64, 601, c.port)
    prefill_request(c.prefill[0], p_req, truth, 8, first_token=7)
    done = run_queues(c, lambda x: x["prefill"] and not d.transfer.queue)
    assert done["decode"] == [] and "aborted by decode" in abort_message(d_req)
    assert "aborted by decode" in abort_message(p_req), abort_message(p_req)
    assert d_req.kv.req_pool_idx is None  # its pages went back to sglang's allocator
    ring_empty(c)


def test_prefill_abort_mid_chunked_prefill_fails_decode_with_reason(cluster_of: Any) -> None:
    """Prefill aborts a request after its first chunk was sent (sglang's `release_aborted_prefill_waiting_req`):
    decode's transfer queue ends it failed with a reason, and decode's ring is empty."""
    c = cluster_of(2, 1)
    d = c.decode[0]
    d_req = new_req("r602", 64, 602, c.port)
    d.call(d.prealloc.add, d_req)
    truth = torch.randn(2, LAYERS, 64, HEADS, DIM).to(torch.bfloat16)
    for p in c.prefill:
        req = new_req("r602", 64, 602, c.port)
        p.call(p.bootstrap.add, req, p.pool.head_num)
        assert p.call(p.bootstrap.pop_bootstrapped) == [req]
        forward(p, req, truth)
        req.extend_end = 16
        p.call(p.sched.send_kv_chunk, req)
        p.call(p.sched.release_aborted_prefill_waiting_req, req)
        assert req.kv.req_pool_idx is None and req.metadata_buffer_index == -1
    done = run_queues(c, lambda x: not d.prealloc.queue and not d.transfer.queue)
    assert done["decode"] == []
    assert "aborted by prefill" in abort_message(d_req), abort_message(d_req)
    ring_empty(c)
