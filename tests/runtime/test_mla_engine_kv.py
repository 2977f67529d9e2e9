"""An MLA model's latent cache in vLLM's layout (`vllm_mla`: one row of kv_lora_rank + rope_dim elements per token,
the same on every TP rank) handed between agents over real sockets and the local shared-memory transport, as the
vLLM connector runs them: every decode rank's rows equal prefill's bit for bit, each decode rank is written by
exactly one prefill rank (rooms take turns over the prefill ranks), and nothing stays in the rings. float32 and
fp8 (held as bytes, as vLLM holds it)."""

from __future__ import annotations

import pytest
import torch
from agent_outcomes import wait_outcomes

from kvstage.dataplane import EngineKV, KVCacheFormat
from kvstage.errors import ConfigError
from kvstage.layout import KVLayout, latent_layout, plan_head_transfers, replica_turn
from kvstage.protocol import DecodeConfig, Timing
from kvstage.protocol.messages import STAGED
from kvstage.protocol.plans import choose_path
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.bootstrap import BootstrapServer

LATENT, LAYERS, PAGE, PAGES, CHUNK, RING = 576, 2, 16, 20, 32, 1 << 20
TIMING = Timing(heartbeat_s=0.1, dead_after_s=2.0, retry_initial_s=0.02, retry_max_s=0.2)
ROOMS = {1: 70, 2: 16, 3: 45}  # room -> prompt tokens


class Rank:
    """One vLLM rank's latent caches: per layer `[blocks, 1, block_size, latent]`, random bytes to start."""

    def __init__(self, layout: KVLayout, gen: torch.Generator) -> None:
        dtype = torch.float32 if layout.dtype == "float32" else torch.uint8
        shape = (LAYERS, PAGES, 1, PAGE, LATENT * layout.itemsize)
        self.raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)  # the bytes of every layer
        self.layers = [layer.view(dtype) for layer in self.raw]
        self.kv = EngineKV.from_layers(layout, KVCacheFormat.VLLM_MLA, self.layers, 1)
        self.free = torch.randperm(PAGES, generator=gen).tolist()

    def rows(self, pages: list[int], tokens: int) -> torch.Tensor:
        """`[layers, tokens, latent bytes]` of a room's tokens, read straight from the caches."""
        slots = torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(tokens)])
        return self.raw.view(LAYERS, PAGES * PAGE, -1)[:, slots]


def _agents(layout: KVLayout, prefill_tp: int, decode_tp: int, bootstrap: str, gen: torch.Generator):
    def start(cls, instance: str, tp: int, rank: int):
        engine = Rank(layout, gen)
        config = AgentConfig(instance=instance, rank=rank, tp_size=tp, layout=layout, bootstrap=bootstrap,
                             attention="mla", timing=TIMING, chunk_tokens=CHUNK, ring_bytes=RING,
                             staging_bytes=RING)  # fmt: skip
        return cls(config, engine.kv).start(), engine

    prefill = [start(PrefillAgent, "P", prefill_tp, r) for r in range(prefill_tp)]
    decode = [start(DecodeAgent, "D", decode_tp, r) for r in range(decode_tp)]
    return prefill, decode


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)], ids=["P2-D1", "P1-D2", "P2-D2"])
def test_every_decode_rank_gets_the_whole_latent_from_one_prefill_rank_bit_exact(prefill_tp, decode_tp, dtype):
    layout = latent_layout(LAYERS, LATENT, dtype, PAGE)
    gen = torch.Generator().manual_seed(prefill_tp * 10 + decode_tp)
    bootstrap = BootstrapServer().start()
    prefill, decode = _agents(layout, prefill_tp, decode_tp, bootstrap.address, gen)
    try:
        landed: dict[tuple[int, int], list[int]] = {}
        written: dict[int, list[int]] = {}
        for room, tokens in ROOMS.items():
            npages = -(-tokens // PAGE)
            for r, (agent, engine) in enumerate(decode):
                pages = landed[room, r] = [engine.free.pop() for _ in range(npages)]
                agent.expect_room(room, tuple(peer_id("P", p) for p in range(prefill_tp)), tokens, 0, tuple(pages),
                                  timeout_s=20)  # fmt: skip
            truth = None
            for agent, engine in prefill:
                pages = [engine.free.pop() for _ in range(npages)]
                if truth is None:
                    truth, written[room] = engine, pages
                else:  # every TP rank computes the same latent rows
                    engine.raw[:, pages] = truth.raw[:, written[room]]
                agent.attach_room(room, tokens, decode_tp, timeout_s=20)
                agent.compute_scheduled(room, tokens)
                agent.kv_ready(room, tokens, tuple(pages))
        for agent, _ in decode + prefill:
            outcomes = wait_outcomes(agent, len(ROOMS))
            assert all(o.ok for o in outcomes.values()), outcomes
        source = prefill[0][1]
        for room, tokens in ROOMS.items():
            want = source.rows(written[room], tokens)
            for r, (_, engine) in enumerate(decode):
                assert torch.equal(engine.rows(landed[room, r], tokens), want), (room, r)
        want_sent = [0] * prefill_tp  # each decode rank's rows come once, from the prefill rank of the room's turn
        for room, tokens in ROOMS.items():
            for t in plan_head_transfers(1, prefill_tp, decode_tp, replica_turn(room, prefill_tp)):
                want_sent[t.prefill_rank] += tokens * LAYERS * LATENT * layout.itemsize
        assert [agent.metrics.value("kvstage_transfer_bytes_total") for agent, _ in prefill] == want_sent
        for agent, _ in decode:
            assert agent.wait_quiescent(5) and agent.snapshot().ring_live_bytes == 0
    finally:
        for agent, _ in decode + prefill:
            agent.close()
        bootstrap.close()


def test_an_mla_decode_rank_on_the_engines_own_kv_stages_every_room():
    config = DecodeConfig(peer_id="D/0", layout=latent_layout(LAYERS, LATENT, "bfloat16", PAGE), tp_size=1, rank=0,
                          chunk_tokens=CHUNK, ring_bytes=RING, attention="mla", staged_only=True)  # fmt: skip
    assert choose_path(config.attention, 2, 1, config.staged_only) == STAGED


def test_an_mla_layout_is_one_head_of_an_even_latent_row():
    layout = latent_layout(LAYERS, LATENT, "float32", PAGE)
    assert (layout.num_kv_heads, layout.head_dim) == (1, LATENT // 2)
    assert layout.bytes_per_token() == LAYERS * LATENT * 4  # each latent element once: K and V are its halves
    with pytest.raises(ConfigError, match="even"):
        latent_layout(LAYERS, 575, "float32", PAGE)
    with pytest.raises(ConfigError, match="one KV head"):
        DecodeConfig(peer_id="D/0", layout=KVLayout(LAYERS, 2, 288, "float32", PAGE), tp_size=1, rank=0,
                     chunk_tokens=CHUNK, ring_bytes=RING, attention="mla")  # fmt: skip
