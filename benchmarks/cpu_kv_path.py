"""Gather and scatter on vLLM's CPU KV cache (`KVCacheFormat.VLLM_CPU`) against a plain copy of the same bytes, per
token, side by side, as medians over runs.

The engine's KV is one rank of an 8B-shaped model by default (32 layers, 8 KV heads, head_dim 128, bf16, vLLM CPU's
default block size 128), allocated as vLLM 0.32's CPU worker does (one allocation, each layer's
`[blocks, heads, block_size, 2 * head_dim]` after the other). One writer block of `--tokens` tokens and `--heads`
heads (from local head `--head-start`), starting `--offset` tokens into a block, is:
- `copy`: a contiguous copy of the block's bytes from one host buffer to another;
- `gather`: `dataplane.gather_slots` from the engine's blocks into the staging buffer (slots looked up once, as the
  prefill agent does per request), run by run (dataplane/tiles.py);
- `scatter`: `dataplane.scatter_slots` from the staging buffer into the engine's blocks;
- with `--planes`, `gather-planes` / `scatter-planes`: the same calls on the same memory through the plane path,
  K one element per (block, position) index (how `vllm_cpu` was copied before dataplane/tiles.py; the store is the
  same views declared `vllm_hnd`, a format without tiles).
Every copy runs on one thread (`torch.set_num_threads(1)`). Each of `--runs` runs draws fresh random blocks and times
every path, interleaved (the median of `--repeats` calls after one warm-up each); the ratio to `copy` is taken
within the run. `--clock wall` times calls by the wall clock, `--clock cpu` by the calling thread's CPU time (on a
shared host it leaves out the time other processes held the core). Printed: ms per token and the ratio, median and
min-max over the runs; `--json` adds one line with every run.

Usage: `python benchmarks/cpu_kv_path.py [--tokens 256] [--block-size 128] [--dtype bfloat16] [--heads 8] [--planes]
[--clock wall|cpu] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvstage.dataplane import EngineKV, KVCacheFormat, gather_slots, scatter_slots, torch_dtype
from kvstage.layout import KVLayout

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def _engine(layout: KVLayout, blocks: int, gen: torch.Generator) -> EngineKV:
    """Random bytes in vLLM CPU's per-layer views of one allocation (fp8 held as uint8, as vLLM holds it)."""
    shape = (layout.num_layers, blocks, layout.num_kv_heads, layout.page_size, 2 * layout.head_bytes)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    typed = raw if layout.itemsize == 1 else raw.view(torch_dtype(layout.dtype))
    return EngineKV.from_layers(layout, KVCacheFormat.VLLM_CPU, list(typed.unbind(0)), layout.num_kv_heads)


def _planes(kv: EngineKV) -> EngineKV:
    """`kv`'s own views under a format without tiles: copied through the plane path."""
    layers = range(kv.layout.num_layers)
    return EngineKV(kv.layout, KVCacheFormat.VLLM_HND, [kv.k(i) for i in layers], [kv.v(i) for i in layers])


def _seconds(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    """Median seconds of `repeats` calls of `fn` after one warm-up call, by `clock`."""
    fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="L32xH8xD128", help="layers x KV heads of the rank x head_dim (8B shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16", "float8_e4m3fn"))
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's block size (vLLM CPU's default: 128)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of one writer block (the connector's chunk)")
    parser.add_argument("--offset", type=int, default=0, help="position of the first token in its block")
    parser.add_argument("--heads", type=int, default=None, help="heads of the writer block (default: the rest)")
    parser.add_argument("--head-start", type=int, default=0, help="first local head of the writer block")
    parser.add_argument("--planes", action="store_true", help="also time the plane path on the same memory")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS), help="wall clock or the thread's CPU time")
    parser.add_argument("--json", action="store_true", help="also print every run as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers, kv_heads, head_dim = (int(x[1:]) for x in args.model.split("x"))
    heads = args.heads or kv_heads - args.head_start
    layout = KVLayout(layers, kv_heads, head_dim, args.dtype, args.block_size)
    used = -(-(args.offset + args.tokens) // args.block_size)
    blocks = 4 * used
    gen = torch.Generator().manual_seed(0)
    stores = {"": _engine(layout, blocks, gen)}
    if args.planes:
        stores["-planes"] = _planes(stores[""])
    nbytes = 2 * layers * args.tokens * heads * layout.head_bytes
    staging = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    source, target = staging.clone(), torch.empty_like(staging)
    runs: dict[str, list[float]] = {}
    for _ in range(args.runs):
        pages = torch.randperm(blocks, generator=gen)[:used].tolist()
        slots = stores[""].request_slots(pages, args.offset, args.offset + args.tokens).slots
        calls: dict[str, Callable[[], object]] = {"copy": lambda: target.copy_(source)}
        for suffix, kv in stores.items():
            calls[f"gather{suffix}"] = lambda kv=kv, s=slots: gather_slots(kv, s, args.head_start, heads, staging, 0)
            calls[f"scatter{suffix}"] = lambda kv=kv, s=slots: scatter_slots(staging, 0, kv, s, args.head_start, heads)
        for name, call in calls.items():
            seconds = _seconds(call, args.repeats, CLOCKS[args.clock])
            runs.setdefault(name, []).append(seconds / args.tokens * 1e3)
    print(
        f"{args.model} {args.dtype} vllm_cpu, block size {args.block_size}, {args.tokens} tokens from position "
        f"{args.offset}, heads [{args.head_start}, {args.head_start + heads}) of {kv_heads}, "
        f"{nbytes / 2**20:.1f} MiB, {args.threads} thread(s); {args.runs} runs of median-of-{args.repeats}, "
        f"{args.clock} clock"
    )
    print(f"{'':14s} {'ms/token median':>16s} {'min-max':>17s} {'x copy median':>14s} {'min-max':>13s}")
    for name, ms in runs.items():
        ratio = [t / c for t, c in zip(ms, runs["copy"], strict=True)]
        print(
            f"{name:14s} {statistics.median(ms):16.4f} {min(ms):8.4f}-{max(ms):<8.4f} "
            f"{statistics.median(ratio):14.2f} {min(ratio):6.2f}-{max(ratio):<6.2f}"
        )
    if args.json:
        print(json.dumps({"args": vars(args), "bytes": nbytes, "ms_per_token": runs}))


if __name__ == "__main__":
    main()
