"""kvstage's sender and receiver driven as sglang 0.5.23's queues drive them (prefill: bootstrap queue -> init ->
one send per chunked-prefill chunk -> inflight queue polls; decode: prealloc queue -> try_ensure_parallel_info ->
init -> send_metadata -> transfer queue polls), over real kvstage agents on the local backend. What lands is
checked bit for bit: KV of every head, and the aux row."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from sglang_harness import PAGE, Cluster, keeps_no_room, make_cluster, wait

_ports = itertools.count(18990)


@pytest.fixture
def cluster_of(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[Cluster] = []

    def make(p_tp: int, d_tp: int, timeout_s: float = 20) -> Cluster:
        made.append(make_cluster(p_tp, d_tp, next(_ports), monkeypatch, timeout_s))
        return made[-1]

    yield make
    for c in made:
        c.close()


def fill_prefill(c: Cluster, room: int, pages: list[int], tokens: int) -> torch.Tensor:
    """sglang's prefill "computes" the KV of `tokens` tokens into `pages` of every rank; returns the whole truth
    `[2, layers, tokens, heads, dim]`."""
    truth = torch.randn(2, len(c.prefill[0].k), tokens, 4, c.prefill[0].k[0].shape[2]).to(torch.bfloat16)
    slots = (torch.tensor(pages).view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)[:tokens]
    for r in c.prefill:
        for layer in range(len(r.k)):
            r.k[layer][slots] = truth[0, layer][:, r.heads.start : r.heads.stop]
            r.v[layer][slots] = truth[1, layer][:, r.heads.start : r.heads.stop]
    return truth


def decode_kv(c: Cluster, pages: list[int], start: int, end: int) -> torch.Tensor:
    slots = (torch.tensor(pages).view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)[start:end]
    per_rank = [torch.stack([torch.stack([r.k[i][slots] for i in range(len(r.k))]),
                             torch.stack([r.v[i][slots] for i in range(len(r.v))])]) for r in c.decode]  # fmt: skip
    return torch.cat(per_rank, dim=3)


def receivers(c: Cluster, room: Any) -> list[Any]:
    from kvstage.integrations.sglang.conn import KVStageKVReceiver

    return [KVStageKVReceiver(r.mgr, c.addr, room) for r in c.decode]


def senders(c: Cluster, room: Any) -> list[Any]:
    from kvstage.integrations.sglang.conn import KVStageKVSender

    return [KVStageKVSender(r.mgr, c.addr, room) for r in c.prefill]


def handoff(c: Cluster, room: int, tokens: int, chunk_pages: int, prefix_pages: int = 0,
            aux_row: int = 3) -> tuple[list[Any], list[Any], list[int], torch.Tensor]:  # fmt: skip
    from sglang.srt.disaggregation.base import KVPoll

    npages = -(-tokens // PAGE)
    p_pages = list(range(1, 1 + npages))  # prefill's pages (0 is sglang's padding page)
    d_pages = list(range(20, 20 + npages))  # decode's; its first prefix_pages already hold the prefix
    truth = fill_prefill(c, room, p_pages, tokens)
    for r in c.decode:  # decode's prefix hit: the prefix is already in its pages
        prefix = torch.tensor(d_pages[:prefix_pages], dtype=torch.int64)
        slots = (prefix.view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)
        for layer in range(len(r.k)):
            r.k[layer][slots] = truth[0, layer, : len(slots), r.heads.start : r.heads.stop]
            r.v[layer][slots] = truth[1, layer, : len(slots), r.heads.start : r.heads.stop]
    recv = receivers(c, room)  # prealloc queue
    wait(lambda: all(r.mgr.try_ensure_parallel_info(c.addr) for r in c.decode))
    for rx in recv:
        assert rx.poll() == KVPoll.Bootstrapping
        rx.init(0)
        rx.send_metadata(d_pages[prefix_pages:], aux_row, None, decode_prefix_len=prefix_pages * PAGE)
    send = senders(c, room)  # bootstrap queue
    for tx in send:
        assert tx.poll() == KVPoll.WaitingForInput
        tx.init(npages, aux_row)
    for r in c.prefill:  # sglang's set_buf: first token, logprobs, room id
        r.aux[0][aux_row].fill_(4242)
        r.aux[1][aux_row].fill_(-0.5)
        r.aux[2][aux_row, 0] = room
    for start in range(0, npages, chunk_pages):  # one send per chunk of chunked prefill
        for tx in send:
            tx.send(torch.tensor(p_pages[start : start + chunk_pages], dtype=torch.int64).numpy(), None)
    return send, recv, d_pages, truth


def finish(send: list[Any], recv: list[Any]) -> tuple[list[int], list[int]]:
    from sglang.srt.disaggregation.base import KVPoll

    done = (KVPoll.Success, KVPoll.Failed)
    wait(lambda: all(x.poll() in done for x in send + recv))
    return [x.poll() for x in send], [x.poll() for x in recv]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize(("tokens", "chunk_pages", "prefix_pages"), [(30, 8, 0), (37, 2, 0), (45, 3, 4)])
def test_handoff_is_bit_exact(cluster_of: Any, p_tp: int, d_tp: int, tokens: int, chunk_pages: int,
                              prefix_pages: int) -> None:  # fmt: skip
    from sglang.srt.disaggregation.base import KVPoll

    c = cluster_of(p_tp, d_tp)
    send, recv, d_pages, truth = handoff(c, 77, tokens, chunk_pages, prefix_pages)
    sp, rp = finish(send, recv)
    assert sp == [KVPoll.Success] * p_tp and rp == [KVPoll.Success] * d_tp, [x.room.failure_reason for x in recv]
    got = decode_kv(c, d_pages, 0, tokens)
    assert torch.equal(got.view(torch.int16), truth.view(torch.int16))
    for r in c.decode:
        assert (r.aux[0][3] == 4242).all() and (r.aux[1][3] == -0.5).all() and r.aux[2][3, 0] == 77
    for r in c.decode:
        assert r.mgr.backend.agent.wait_quiescent(5) and r.mgr.backend.agent.snapshot().ring_live_bytes == 0


def test_prefix_is_never_written(cluster_of: Any) -> None:
    """Decode's prefix pages are named by sglang's padding page 0, which kvstage must never write."""
    from sglang.srt.disaggregation.base import KVPoll

    c = cluster_of(1, 1)
    send, recv, _, _ = handoff(c, 78, 40, 4, prefix_pages=4)
    assert finish(send, recv) == ([KVPoll.Success], [KVPoll.Success])
    r = c.decode[0]
    assert all(not r.k[i][:PAGE].any() and not r.v[i][:PAGE].any() for i in range(len(r.k)))


def failed(c: Cluster, xs: list[Any]) -> list[str]:
    from sglang.srt.disaggregation.base import KVPoll

    wait(lambda: all(x.poll() == KVPoll.Failed for x in xs))
    reasons = []
    for x in xs:
        with pytest.raises(Exception) as exc:
            x.failure_exception()
        reasons.append(str(exc.value))
    return reasons


def ring_empty(c: Cluster) -> None:
    for r in c.decode:
        agent = r.mgr.backend.agent
        wait(lambda a=agent: a.wait_quiescent(0.05) and a.snapshot().ring_live_bytes == 0)


@pytest.mark.parametrize("room", [0, -5, 2**63, "12", None])
def test_malformed_room_fails_with_reason(cluster_of: Any, room: Any) -> None:
    c = cluster_of(1, 1)
    reasons = failed(c, senders(c, room) + receivers(c, room))
    assert all("malformed room" in why for why in reasons)
    assert c.prefill[0].mgr.backend.refused["malformed room"] == 1


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_planted_bug_aux_row_not_sent_is_caught(cluster_of: Any, monkeypatch: pytest.MonkeyPatch, p_tp: int,
                                                d_tp: int) -> None:  # fmt: skip
    """With prefill's last send giving no aux row, decode must not report success: its KV landed, but sglang would
    read a first token it never got. Every decode rank fails the room with the reason instead, at once."""
    from kvstage.integrations.sglang.rooms import SenderRoom

    monkeypatch.setattr(SenderRoom, "aux_row", lambda self: b"")
    c = cluster_of(p_tp, d_tp)
    _, recv, *_ = handoff(c, 82, 30, 8)
    assert all("aux row not received" in why for why in failed(c, recv))
    for r in c.decode:
        assert not r.aux[2][3].any()  # the room id never landed: sglang's metadata gate holds the request


def test_prefill_abort(cluster_of: Any) -> None:
    c = cluster_of(2, 1)
    send, recv, *_ = handoff(c, 79, 40, 2)
    for tx in send:
        tx.abort()
    assert all("aborted by prefill" in why for why in failed(c, send))
    wait(lambda: all(rx.poll() in (0, 4) for rx in recv))  # decode: failed, or done if it all landed first
    ring_empty(c)


def test_decode_abort(cluster_of: Any) -> None:
    from sglang.srt.disaggregation.base import KVPoll

    c = cluster_of(1, 1)
    recv = receivers(c, 80)
    wait(lambda: c.decode[0].mgr.try_ensure_parallel_info(c.addr))
    recv[0].init(0)
    recv[0].send_metadata(list(range(20, 30)), 3, None, decode_prefix_len=0)
    recv[0].abort()
    assert "aborted by decode" in failed(c, recv)[0]
    send = senders(c, 80)
    send[0].init(10, 3)
    send[0].send(list(range(1, 11)), None)
    wait(lambda: send[0].poll() == KVPoll.Failed)
    ring_empty(c)


def test_a_room_sglang_clears_before_its_outcome_leaves_no_outcome_behind(cluster_of: Any) -> None:
    """sglang may clear a receiver right after aborting it, before kvstage's outcome comes: the outcome is discarded
    when it comes, so the backend keeps nothing of the room (before, it stayed in the outcome table for good)."""
    c = cluster_of(1, 1)
    (rx,) = receivers(c, 83)
    wait(lambda: c.decode[0].mgr.try_ensure_parallel_info(c.addr))
    rx.init(0)
    rx.send_metadata(list(range(20, 30)), 3, None, decode_prefix_len=0)
    rx.abort()
    rx.clear()
    backend = c.decode[0].mgr.backend
    assert backend.kept_outcomes() == 1  # the outcome it still owes is marked for discarding
    wait(lambda: backend.take_outcome(0) is None and backend.kept_outcomes() == 0)
    (tx,) = senders(c, 83)  # prefill hears of the abort; its room fails and it, too, keeps nothing once cleared
    tx.init(10, 3)
    wait(lambda: tx.poll() == 0)
    tx.clear()
    assert c.prefill[0].mgr.backend.kept_outcomes() == 0


def test_dead_peer(cluster_of: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode waits for a prefill rank that dies before it sends: the room fails with a reason, the ring is empty."""
    c = cluster_of(1, 1)
    recv = receivers(c, 81)
    wait(lambda: c.decode[0].mgr.try_ensure_parallel_info(c.addr))
    recv[0].init(0)
    recv[0].send_metadata(list(range(20, 30)), 3, None, decode_prefix_len=0)
    send = senders(c, 81)
    send[0].init(10, 3)
    send[0].send(list(range(1, 6)), None)
    c.prefill[0].mgr.backend.agent.close()  # the prefill rank's agent dies mid-room
    reason = failed(c, recv)[0]
    assert any(w in reason for w in ("peer dead", "timeout", "aborted by prefill", "peer restarted")), reason
    ring_empty(c)


def test_a_send_beyond_the_announced_pages_fails_the_room_and_keeps_nothing_of_it(cluster_of: Any) -> None:
    """A send of more pages than `init` announced fails the room with `invalid request` and aborts it in the agent.
    sglang never clears a failed sender, so the backend drops the room's outcome itself: it keeps nothing of it."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    c = cluster_of(1, 1)
    (tx,) = senders(c, 84)
    tx.init(2, 3)
    tx.send(list(range(1, 4)), None)
    assert tx.poll() == 0
    with pytest.raises(KVTransferError, match="invalid request: send of 3 pages of 2"):
        tx.failure_exception()
    keeps_no_room(c.prefill[0].mgr.backend, ended=1)
