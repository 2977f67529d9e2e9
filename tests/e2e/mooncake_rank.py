"""One TP rank of tests/e2e/test_hosts_agents.py, run as a script inside a host's namespace: a prefill or decode
runtime agent on the mooncake backend, bound to the host's address, handing off seeded KV; its outcomes, decode's
bit-exact check and its engine's session are written as JSON to `--out`."""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from kvstage.dataplane import KVPool
from kvstage.layout import KVLayout, heads_of_rank, pages_for
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent
from kvstage.transport.auth import load_secret
from kvstage.transport.data import TransportConfig

#: The tiny model's KV (tests/e2e's `TinyModelSpec`) in vLLM CPU's 128-token blocks.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_size=128)


def seeded_kv(room: int, tokens: int) -> torch.Tensor:
    """The whole KV of `room` ([2, layers, tokens, heads, head_dim]); both sides compute it from the room id."""
    gen = torch.Generator().manual_seed(room)
    return torch.randn((2, LAYOUT.num_layers, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=gen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("prefill", "decode"))
    ap.add_argument("instance")
    ap.add_argument("rank", type=int)
    ap.add_argument("tp", type=int)
    ap.add_argument("--host", required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--peer", required=True, help="the other side's instance and TP size, NAME:TP")
    ap.add_argument("--rooms", required=True, help="room ids, comma separated")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--linger", type=float, required=True, help="seconds to keep serving after the last outcome")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.instance}/{args.rank} %(name)s %(message)s")
    rooms = [int(r) for r in args.rooms.split(",")]
    peer, peer_tp = args.peer.split(":")
    npages = pages_for(args.tokens, LAYOUT.page_size)
    pool = KVPool.for_rank(LAYOUT, args.tp, args.rank, npages * len(rooms))
    config = AgentConfig(
        instance=args.instance,
        rank=args.rank,
        tp_size=args.tp,
        layout=LAYOUT,
        bootstrap=args.bootstrap,
        transport=TransportConfig(backend="mooncake", host=args.host),
        control_bind=f"tcp://{args.host}:*",
        chunk_tokens=128,
        ring_bytes=8 << 20,
        timing=Timing(heartbeat_s=1.0, dead_after_s=10.0),
        secret=load_secret(None),
    )
    heads = heads_of_rank(LAYOUT.num_kv_heads, args.tp, args.rank)
    agent = PrefillAgent(config, pool) if args.role == "prefill" else DecodeAgent(config, pool)
    agent.start()
    session = getattr(agent.transport, "session", "")
    pages = {room: pool.allocator.allocate(npages, owner=room) for room in rooms}
    outcomes: dict[int, tuple[bool, str]] = {}
    verified: dict[int, bool] = {}
    try:
        if args.role == "prefill":
            for room in rooms:
                slots = pool.slot_indices(pages[room], 0, args.tokens)
                pool.kv[:, :, slots] = seeded_kv(room, args.tokens)[:, :, :, heads.start : heads.stop]
                agent.attach_room(room, args.tokens, int(peer_tp), args.timeout)
                agent.compute_scheduled(room, args.tokens)
                agent.kv_ready(room, args.tokens, tuple(pages[room]))
        else:
            peers = agent.connect(peer, int(peer_tp), timeout_s=args.timeout)
            for room in rooms:
                agent.expect_room(room, peers, args.tokens, 0, tuple(pages[room]), args.timeout)
        deadline = time.monotonic() + args.timeout + 5.0
        while time.monotonic() < deadline and len(outcomes) < len(rooms):
            outcomes.update((o.room, (o.ok, o.reason)) for o in agent.poll())
            time.sleep(0.01)
        if args.role == "decode":
            for room, (ok, _) in outcomes.items():
                if ok:
                    want = seeded_kv(room, args.tokens)[:, :, :, heads.start : heads.stop]
                    verified[room] = torch.equal(pool.kv[:, :, pool.slot_indices(pages[room], 0, args.tokens)], want)
        time.sleep(args.linger)  # prefill: decode may still be checking; its engine keeps answering meanwhile
    finally:
        agent.close()
    with open(args.out, "w") as out:
        json.dump({"session": session, "outcomes": outcomes, "verified": verified}, out)


if __name__ == "__main__":
    main()
