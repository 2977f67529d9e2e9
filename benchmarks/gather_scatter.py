"""Gather/scatter throughput against a plain copy of the same bytes, side by side in one run.

Measures, on one device (CUDA when present, else CPU), for one writer block of a chunk:
- `copy`: a contiguous device copy of the block's bytes (the ceiling for moving those bytes once);
- `gather`: kvstage's vectorised gather from random non-contiguous pages into a staging block;
- `scatter`: kvstage's vectorised scatter of that block back into random pages;
- `gather-cached` / `scatter-cached`: the same with the request's slot indices validated once and reused;
- `per-layer`: a naive gather with one `index_select` per layer and K/V over a strided head slice.
Reports GB/s (block bytes, one way) and each path's ratio to `copy`. Ratios, not absolute times, are the result:
the machines are shared. Usage: `python benchmarks/gather_scatter.py [--tokens 4096] [--device cuda]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvstage.dataplane import KVPool, StagingBuffer, gather, gather_slots, scatter, scatter_slots
from kvstage.layout import KVLayout, heads_of_rank, plan_staging

PATHS = ("copy", "gather", "scatter", "gather-cached", "scatter-cached", "per-layer")


def _timer(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` after two warm-up calls; CUDA events on the GPU, a host clock on the CPU."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(tokens: int, page_size: int, device: torch.device, repeats: int) -> dict[str, float]:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=page_size)
    prefill_tp, decode_tp = 4, 2
    plan = plan_staging(layout, prefill_tp, decode_tp, decode_rank=0, num_tokens=tokens)
    block = plan.blocks[0]
    num_pages = 2 * tokens // page_size
    src = KVPool.for_rank(layout, prefill_tp, block.prefill_rank, num_pages, device)
    dst = KVPool.for_rank(layout, decode_tp, 0, num_pages, device)
    src.flat.copy_(torch.randint(0, 256, (src.flat.numel(),), dtype=torch.uint8, device=device))
    generator = torch.Generator().manual_seed(0)
    src_pages = torch.randperm(num_pages, generator=generator)[: tokens // page_size].tolist()
    dst_pages = torch.randperm(num_pages, generator=generator)[: tokens // page_size].tolist()
    src.allocator.allocate(num_pages)
    dst.allocator.allocate(num_pages)
    staging = StagingBuffer(plan.total_bytes, device).flat
    spare = torch.empty_like(staging[: block.nbytes])
    heads = slice(block.transfer.src_head_start, block.transfer.src_head_start + block.transfer.num_heads)
    slots = src.slot_indices(src_pages, 0, tokens)
    dst_slots = dst.slot_indices(dst_pages, 0, tokens)
    src_heads = (block.transfer.src_head_start, block.transfer.num_heads)
    dst_heads = (block.transfer.dst_head_start, block.transfer.num_heads)

    def per_layer() -> None:
        shape = (2, layout.num_layers, tokens, block.transfer.num_heads, layout.head_dim)
        out = staging[: block.nbytes].view(torch.bfloat16).view(shape)
        for kv in range(2):
            for layer in range(layout.num_layers):
                torch.index_select(src.kv[kv, layer][:, heads], 0, slots, out=out[kv, layer])

    paths: dict[str, Callable[[], object]] = {
        "copy": lambda: spare.copy_(staging[: block.nbytes]),
        "gather": lambda: gather(
            src, src_pages, 0, tokens, block.transfer.src_head_start, block.transfer.num_heads, staging, block.offset
        ),
        "scatter": lambda: scatter(
            staging, block.offset, dst, dst_pages, 0, tokens, block.transfer.dst_head_start, block.transfer.num_heads
        ),
        "gather-cached": lambda: gather_slots(src, slots, *src_heads, staging, block.offset),
        "scatter-cached": lambda: scatter_slots(staging, block.offset, dst, dst_slots, *dst_heads),
        "per-layer": per_layer,
    }
    assert len(heads_of_rank(8, prefill_tp, block.prefill_rank)) == 2
    seconds = {name: _timer(device, fn, repeats) for name, fn in paths.items()}
    result = {f"{name}_gbps": block.nbytes / s / 1e9 for name, s in seconds.items()}
    for name in PATHS[1:]:
        result[f"{name}_over_copy"] = seconds["copy"] / seconds[name]
    result["block_bytes"] = float(block.nbytes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    result = run(args.tokens, args.page_size, device, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    mib = result["block_bytes"] / 2**20
    print(f"device={name} tokens={args.tokens} page_size={args.page_size} block={mib:.0f} MiB")
    for path in PATHS:
        ratio = "" if path == "copy" else f"  {result[f'{path}_over_copy']:.2f}x copy"
        print(f"{path:>14}: {result[f'{path}_gbps']:8.1f} GB/s{ratio}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
