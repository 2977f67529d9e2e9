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

from typing import Any

import pytest
import torch
from sglang_harness import keeps_no_room
from sglang_queues_harness import (
    DIM,
    HEADS,
    LAYERS,
    abort_message,
    decode_kv,
    forward,
    handoff,
    new_req,
    prefill_request,
    ring_empty,
    run_queues,
    wait,
)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize(("tokens", "chunk_tokens"), [(30, 64), (37, 8), (45, 12)])
def test_real_queues_land_kv_bit_exact(queues_of: Any, p_tp: int, d_tp: int, tokens: int,
                                       chunk_tokens: int) -> None:  # fmt: skip
    c = queues_of(p_tp, d_tp)
    _, d_reqs, truth = handoff(c, 501, tokens, chunk_tokens)
    done = run_queues(c, lambda d: len(d["prefill"]) == p_tp and len(d["decode"]) == d_tp)
    assert done["decode_failed"] == []
    got = decode_kv(c, d_reqs, tokens)
    assert torch.equal(got.view(torch.int16), truth.view(torch.int16))
    for req in d_reqs:  # the aux row landed: decode's Req took prefill's first token from it
        assert list(req.output_ids) == [4242], req.output_ids
    ring_empty(c)


@pytest.mark.parametrize("room", [0, None])
def test_malformed_room_is_aborted_by_both_queues(queues_of: Any, room: Any) -> None:
    """Room 0 (sglang's "no metadata yet" marker) and no room at all: the bootstrap queue and the prealloc queue
    each abort the request with kvstage's reason, and nothing is allocated for it."""
    c = queues_of(1, 1)
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


def test_decode_abort_ends_both_sides_failed_and_frees_the_ring(queues_of: Any) -> None:
    """Decode aborts a request in its transfer queue (the receiver's `abort`, as sglang's abort path calls it):
    the transfer queue releases it with kvstage's reason, prefill's inflight queue ends it failed."""
    c = queues_of(1, 1)
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


def test_prefill_abort_mid_chunked_prefill_fails_decode_with_reason(queues_of: Any) -> None:
    """Prefill aborts a request after its first chunk was sent (sglang's `release_aborted_prefill_waiting_req`):
    decode's transfer queue ends it failed with a reason, and decode's ring is empty. sglang never clears the
    aborted sender, so prefill's backends must drop the room's outcome themselves: they keep nothing of it."""
    c = queues_of(2, 1)
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
    for p in c.prefill:
        keeps_no_room(p.kv_manager.backend, ended=1)
