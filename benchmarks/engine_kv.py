"""Gather/scatter throughput on an engine's own KV (`EngineKV`, every format) against a `KVPool`, medians over runs.

One writer block of one chunk (default: Llama-3-8B, prefill TP 4 -> decode TP 2, bf16, page 16: 2 of a rank's 4
KV heads, every layer, K and V), on one device (CUDA when present, else CPU), through `dataplane.stage`'s `gather`
and `scatter` (the page check and slot lookup in every call; the scatter waits until its bytes landed). Staging
sits on the KV's device, or in host memory with `--host-staging` (what the DRAM transports register). Each of
`--runs` runs draws fresh random pages and times every store, interleaved (median of `--repeats` calls after a
warm-up). Printed: GB/s (block bytes over time, one way), median and min-max over the runs; the last line is JSON
with every run.

Usage: `python benchmarks/engine_kv.py [--tokens 4096] [--page-size 16] [--device cuda] [--host-staging]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvstage.dataplane import EngineKV, KVCacheFormat, KVPool, KVStore, gather, scatter, torch_dtype
from kvstage.layout import KVLayout


def engine_layers(fmt: KVCacheFormat, layout: KVLayout, heads: int, pages: int, device: str) -> list:
    """Zeroed per-layer tensors as the engine of `fmt` allocates them."""
    n, d, dtype = layout.page_size, layout.head_dim, torch_dtype(layout.dtype)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    if fmt is KVCacheFormat.KVSTAGE:
        return [zeros(2, pages * n, heads, d) for _ in range(layout.num_layers)]
    if fmt is KVCacheFormat.SGLANG:
        return [(zeros(pages * n, heads, d), zeros(pages * n, heads, d)) for _ in range(layout.num_layers)]
    if fmt is KVCacheFormat.VLLM_NHD:
        return [zeros(pages, n, heads, 2 * d).transpose(1, 2) for _ in range(layout.num_layers)]
    return [zeros(pages, heads, n, 2 * d) for _ in range(layout.num_layers)]


def timed(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--model", default="L32xH8xD128", help="layers x KV heads x head_dim (Llama-3-8B)")
    parser.add_argument("--local-heads", type=int, default=4, help="KV heads of the rank (prefill TP 2 of 8)")
    parser.add_argument("--block-heads", type=int, default=2, help="heads of one writer block")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--host-staging", action="store_true")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    layers, kv_heads, head_dim = (int(x[1:]) for x in args.model.split("x"))
    layout = KVLayout(layers, kv_heads, head_dim, "bfloat16", args.page_size)
    pages = 2 * -(-args.tokens // args.page_size)
    pool = KVPool(layout, args.local_heads, pages, args.device)
    pool.allocator.allocate(pages)
    stores: dict[str, KVStore] = {"kvpool": pool}
    for fmt in KVCacheFormat:
        layers_ = engine_layers(fmt, layout, args.local_heads, pages, args.device)
        stores[f"engine-{fmt.value}"] = EngineKV.from_layers(layout, fmt, layers_, args.local_heads)
    nbytes = 2 * layers * args.tokens * args.block_heads * layout.head_bytes
    staging = torch.zeros(nbytes, dtype=torch.uint8, device="cpu" if args.host_staging else args.device)
    if args.host_staging and args.device.startswith("cuda"):
        staging = staging.pin_memory()
    results: dict[str, dict[str, list[float]]] = {name: {"gather": [], "scatter": []} for name in stores}
    for _ in range(args.runs):
        used = torch.randperm(pages)[: -(-args.tokens // args.page_size)].tolist()
        for name, kv in stores.items():
            for op in ("gather", "scatter"):
                if op == "gather":
                    seconds = timed(
                        lambda kv=kv, used=used: gather(kv, used, 0, args.tokens, 1, args.block_heads, staging, 0),
                        args.repeats,
                        args.device,
                    )
                else:
                    seconds = timed(
                        lambda kv=kv, used=used: scatter(staging, 0, kv, used, 0, args.tokens, 1, args.block_heads),
                        args.repeats,
                        args.device,
                    )
                results[name][op].append(nbytes / seconds / 1e9)
    where = "host" if args.host_staging else args.device
    print(f"{args.model} bf16, {args.tokens} tokens, page {args.page_size}, {nbytes / 2**20:.0f} MiB blocks, "
          f"KV on {args.device}, staging on {where}; GB/s median [min-max] over {args.runs} runs")  # fmt: skip
    for name, ops in results.items():
        cells = [f"{op} {statistics.median(v):7.2f} [{min(v):.2f}-{max(v):.2f}]" for op, v in ops.items()]
        print(f"{name:18s} " + "   ".join(cells))
    print(json.dumps({"args": vars(args), "gbps": results}))


if __name__ == "__main__":
    main()
