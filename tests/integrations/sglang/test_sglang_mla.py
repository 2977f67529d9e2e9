"""An MLA model's KV through kvstage's sglang backend: sglang's MLA pool holds one latent buffer `[slots, 1,
kv_lora_rank + rope_dim]` per layer, the same on every TP rank, and hands the backend only those buffers (no K/V
split, no head counts). kvstage moves the latent as it moves vLLM's (one head every rank holds whole), so each
decode rank gets the whole latent from one prefill rank. Driven as sglang's queues drive the sender and receiver
(test_sglang_transfer.py), over real agents on the local backend; checked bit for bit on every decode rank. From a
larger prefill TP some prefill ranks write nothing: decode rank 0's writes-nothing notice (`Metadata.bystander`)
ends their side of the room at once, as sglang's own backends' dummy requests do."""

from __future__ import annotations

import itertools

import pytest
import torch
from sglang_harness import LATENT, PAGE, make_cluster, wait
from test_sglang_transfer import finish, receivers, senders

_ports = itertools.count(18960)


def _slots(pages: list[int], tokens: int) -> torch.Tensor:
    return (torch.tensor(pages).view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)[:tokens]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 2), (1, 1), (2, 1), (4, 2)])
def test_an_mla_latent_lands_whole_and_bit_exact_on_every_decode_rank(
    monkeypatch: pytest.MonkeyPatch, p_tp: int, d_tp: int
) -> None:
    from sglang.srt.disaggregation.base import KVPoll

    c = make_cluster(p_tp, d_tp, next(_ports), monkeypatch, mla=True)
    try:
        tokens, room = 37, 91
        npages = -(-tokens // PAGE)
        p_pages, d_pages = list(range(1, 1 + npages)), list(range(30, 30 + npages))
        truth = torch.randn(len(c.prefill[0].k), tokens, LATENT).to(torch.bfloat16)
        for r in c.prefill:  # every prefill rank computes the same latent
            for layer, buffer in enumerate(r.k):
                buffer[_slots(p_pages, tokens), 0] = truth[layer]
        recv = receivers(c, room)
        wait(lambda: all(r.mgr.try_ensure_parallel_info(c.addr) for r in c.decode))
        for rx in recv:
            rx.init(0)
            rx.send_metadata(d_pages, 2, None, decode_prefix_len=0)
        send = senders(c, room)
        for tx in send:
            tx.init(npages, 2)
        for start in range(0, npages, 3):
            for tx in send:
                tx.send(torch.tensor(p_pages[start : start + 3], dtype=torch.int64).numpy(), None)
        sp, rp = finish(send, recv)
        assert sp == [KVPoll.Success] * p_tp and rp == [KVPoll.Success] * d_tp, [x.room.failure_reason for x in send]
        for r in c.decode:
            got = torch.stack([buffer[_slots(d_pages, tokens), 0] for buffer in r.k])
            assert torch.equal(got.view(torch.int16), truth.view(torch.int16))
            assert r.mgr.backend.agent.wait_quiescent(5) and r.mgr.backend.agent.snapshot().ring_live_bytes == 0
    finally:
        c.close()
