"""A cluster of sglang-shaped ranks on one host: sglang's KV buffers (per layer K and V, `[slots, heads, dim]`; or,
for an MLA model, per layer one latent buffer `[slots, 1, LATENT]`, whole on every rank), its aux rows, its real
`KVArgs`, and kvstage's sglang classes built on them, as sglang's queues build them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvstage.layout import heads_of_rank
from kvstage.transport.bootstrap import BootstrapServer

LAYERS, HEADS, DIM, PAGE, SLOTS_PAGES, AUX_ROWS = 2, 4, 8, 4, 64, 8
LATENT = 24  # an MLA latent row: kv_lora_rank + rope_dim elements


@dataclass
class Rank:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    aux: list[torch.Tensor]
    heads: range
    mgr: Any = None
    mla: bool = False  # `k` holds the latent buffers, `v` is empty

    def kv_args(self, rank: int) -> Any:
        from sglang.srt.disaggregation.base import KVArgs

        args = KVArgs()
        args.engine_rank, args.pp_rank, args.page_size = rank, 0, PAGE
        args.kv_data_ptrs = [t.data_ptr() for t in self.k + self.v]
        args.kv_data_lens = [t.nbytes for t in self.k + self.v]
        args.kv_item_lens = [t[0].nbytes * PAGE for t in self.k + self.v]
        args.kv_cache_dtype_str = "bfloat16"
        if not self.mla:  # sglang's MLA queues set neither
            args.kv_head_num, args.total_kv_head_num = len(self.heads), HEADS
        args.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        args.aux_data_lens = [t.nbytes for t in self.aux]
        args.aux_item_lens = [t[0].nbytes for t in self.aux]
        args.state_types, args.num_draft_entries, args.gpu_id = [], 0, 0
        return args


def new_rank(tp: int, rank: int, mla: bool = False) -> Rank:
    if mla:
        latent = [torch.zeros(SLOTS_PAGES * PAGE, 1, LATENT, dtype=torch.bfloat16) for _ in range(LAYERS)]
        return Rank(latent, [], _aux(), range(1), mla=True)
    heads = heads_of_rank(HEADS, tp, rank)
    n = len(heads)
    k = [torch.zeros(SLOTS_PAGES * PAGE, n, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(SLOTS_PAGES * PAGE, n, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return Rank(k, v, _aux(), heads)


def _aux() -> list[torch.Tensor]:
    return [torch.zeros(AUX_ROWS, 16, dtype=torch.int32), torch.zeros(AUX_ROWS, 16, dtype=torch.float32),
            torch.zeros(AUX_ROWS, 1, dtype=torch.int64)]  # fmt: skip


@dataclass
class Cluster:
    prefill: list[Rank]
    decode: list[Rank]
    mailbox: Any
    directory: BootstrapServer
    addr: str
    truth: dict[int, torch.Tensor] = field(default_factory=dict)

    def close(self) -> None:
        for r in self.prefill + self.decode:
            r.mgr.close()
        self.mailbox.close()
        self.directory.close()


def make_cluster(
    p_tp: int, d_tp: int, port: int, monkeypatch: Any, timeout_s: float = 20, mla: bool = False
) -> Cluster:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvstage.integrations.sglang.conn import KVStageBootstrapServer, KVStageKVManager

    directory = BootstrapServer().start()
    monkeypatch.setenv("KVSTAGE_BOOTSTRAP", directory.address)
    monkeypatch.setenv("KVSTAGE_CHUNK_TOKENS", "8")
    monkeypatch.setenv("KVSTAGE_RING_MIB", "1")
    monkeypatch.setenv("KVSTAGE_STAGING_MIB", "1")
    monkeypatch.setenv("KVSTAGE_ROOM_TIMEOUT_S", str(timeout_s))
    mailbox = KVStageBootstrapServer("127.0.0.1", port)
    cluster = Cluster([new_rank(p_tp, r, mla) for r in range(p_tp)], [new_rank(d_tp, r, mla) for r in range(d_tp)],
                      mailbox, directory, f"127.0.0.1:{port}")  # fmt: skip
    for role, ranks, tp, mode in (("prefill", cluster.prefill, p_tp, DisaggregationMode.PREFILL),
                                  ("decode", cluster.decode, d_tp, DisaggregationMode.DECODE)):  # fmt: skip
        monkeypatch.setenv("KVSTAGE_INSTANCE", f"sg-{role}-{port}")
        server_args = SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=port, tp_size=tp, dp_size=1,
                                      device="cpu")  # fmt: skip
        for rank, r in enumerate(ranks):
            r.mgr = KVStageKVManager(r.kv_args(rank), mode, server_args, mla)
    return cluster


def wait(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def keeps_no_room(backend: Any, ended: int) -> None:
    """Once a rank's agent has ended `ended` rooms in all and holds none, its backend (`RankBackend`) keeps no
    outcome of any: what the agent reported is drained first (room 0 is never a room). The agent's snapshot, which
    lags by up to 10 ms, counts a room as ended only once its outcome is out."""

    def ended_all() -> bool:
        snap = backend.agent.snapshot()
        done = snap.stats.get("rooms_succeeded", 0) + snap.stats.get("rooms_failed", 0)
        return done >= ended and snap.open_rooms == 0 and snap.quiescent

    wait(ended_all)
    assert backend.take_outcome(0) is None
    assert backend.kept_outcomes() == 0, backend.kept_outcomes()
