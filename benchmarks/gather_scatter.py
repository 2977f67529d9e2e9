"""Gather/scatter throughput against a device copy of the same bytes, side by side, as medians over runs.

For one writer block of one chunk (default: Llama-3-8B, prefill TP 4 -> decode TP 2, bf16, page 16), on one
device (CUDA when present, else CPU), each case times:
- `copy`: a contiguous device copy of the block's bytes (the ceiling for moving those bytes once);
- `gather-torch` / `scatter-torch`: the torch path (one `index_select` / `index_copy_` over every layer and K and V
  of the pool's integer view), slots looked up once;
- `gather-triton` / `scatter-triton`: `dataplane.kernels` (one Triton launch), slots looked up once (CUDA only);
- `gather` / `scatter`: `dataplane.stage`'s calls with the page check and slot lookup in every call, through
  whichever kernel stage picks for the device (the scatter also waits until its bytes landed);
- `region-scatter-triton` (CUDA, a decode rank with several writers): the whole chunk region, every writer's block,
  scattered in one launch as the decode agent does (`queue_scatter_region`), against `region-copy`, a device copy
  of the region's bytes.
Each of `--runs` runs draws fresh random pages and times every path, interleaved (median of `--repeats` timings
after warm-up, each of `--batch` calls between two CUDA events: 1 counts a call's host-side launch cost, 10 only
the device time); the ratio to `copy` is taken within the run. Printed: GB/s (block bytes
over time, one way) and ratio, as median and min-max over the runs; the last line is JSON with every run.
`--sweep` times the Triton paths over a grid of launch configurations instead.

Usage: `python benchmarks/gather_scatter.py [--tokens 4096 16384] [--page-size 16] [--dtype bfloat16] [--tp 4:2]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstage.dataplane import KVPool, StagingBuffer, gather, queue_scatter_region, scatter
from kvstage.dataplane.pool import WORD_DTYPES
from kvstage.layout import KVLayout, plan_staging

if TYPE_CHECKING:
    from kvstage.dataplane.kernels import LaunchConfig

Path = Callable[[], object]
SWEEP_TILE_BYTES = (8192, 16384, 32768, 65536)
SWEEP_WARPS = (4, 8)


@dataclass(frozen=True)
class Case:
    tokens: int
    page_size: int
    dtype: str
    prefill_tp: int
    decode_tp: int
    layers: int
    heads: int
    head_dim: int

    def __str__(self) -> str:
        return (
            f"L{self.layers}xH{self.heads}xD{self.head_dim} {self.dtype} P={self.prefill_tp}->D={self.decode_tp} "
            f"tokens={self.tokens} page={self.page_size}"
        )


def _seconds(device: torch.device, fn: Path, repeats: int, batch: int) -> float:
    """Median seconds per call of `fn`, timed `batch` calls at a time (1: each call alone, so its host-side
    launch cost counts; more: back to back, so the device time counts); CUDA events on the GPU, a host clock on
    the CPU."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / batch)
        else:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


class Setup:
    """One case's pools, staging and block, with fresh random pages per `draw`."""

    def __init__(self, case: Case, device: torch.device) -> None:
        self.case, self.device = case, device
        layout = KVLayout(case.layers, case.heads, case.head_dim, case.dtype, case.page_size)
        plan = plan_staging(layout, case.prefill_tp, case.decode_tp, 0, case.tokens)
        self.plan, self.block = plan, plan.blocks[0]
        self.num_pages = 2 * -(-case.tokens // case.page_size)
        self.src = KVPool.for_rank(layout, case.prefill_tp, self.block.prefill_rank, self.num_pages, device)
        self.dst = KVPool.for_rank(layout, case.decode_tp, 0, self.num_pages, device)
        for pool in (self.src, self.dst):
            pool.flat.copy_(torch.randint(0, 256, (pool.flat.numel(),), dtype=torch.uint8, device=device))
            pool.allocator.allocate(self.num_pages)
        self.staging = StagingBuffer(plan.total_bytes, device).flat
        self.spare = torch.empty_like(self.staging[: self.block.nbytes])
        self.region_spare = torch.empty_like(self.staging)
        self.generator = torch.Generator().manual_seed(0)
        self.draw()

    def draw(self) -> None:
        """Fresh random pages (and their slots) on both sides."""
        used = -(-self.case.tokens // self.case.page_size)
        self.src_pages = torch.randperm(self.num_pages, generator=self.generator)[:used].tolist()
        self.dst_pages = torch.randperm(self.num_pages, generator=self.generator)[:used].tolist()
        self.src_slots = self.src.slot_indices(self.src_pages, 0, self.case.tokens)
        self.dst_slots = self.dst.slot_indices(self.dst_pages, 0, self.case.tokens)

    def copy(self) -> None:
        """The block's bytes copied once, contiguously: the ceiling every path is measured against."""
        self.spare.copy_(self.staging[: self.block.nbytes])

    def region_copy(self) -> None:
        """The whole region's bytes copied once: the ceiling of the region scatter."""
        self.region_spare.copy_(self.staging)

    def _torch_views(self, pool: KVPool, head_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool heads `[2, L, slots, heads, words]`, block `[2, L, tokens, heads, words]`): the torch path's views."""
        layout, heads = pool.layout, self.block.transfer.num_heads
        word = next(w for w in (8, 4, 2, 1) if layout.head_bytes % w == 0)
        region = self.staging[self.block.offset : self.block.offset + self.block.nbytes].view(WORD_DTYPES[word])
        shape = (2, layout.num_layers, self.case.tokens, heads, layout.head_bytes // word)
        return pool.words(word)[:, :, :, head_start : head_start + heads], region.view(shape)

    def paths(self) -> dict[str, Path]:
        t, b = self.block.transfer, self.block
        src_heads, block_view = self._torch_views(self.src, t.src_head_start)
        dst_heads, _ = self._torch_views(self.dst, t.dst_head_start)
        paths: dict[str, Path] = {
            "copy": self.copy,
            "gather-torch": lambda: torch.index_select(src_heads, 2, self.src_slots, out=block_view),
            "scatter-torch": lambda: dst_heads.index_copy_(2, self.dst_slots, block_view),
            "gather": lambda: gather(
                self.src, self.src_pages, 0, self.case.tokens, t.src_head_start, t.num_heads, self.staging, b.offset
            ),
            "scatter": lambda: scatter(
                self.staging, b.offset, self.dst, self.dst_pages, 0, self.case.tokens, t.dst_head_start, t.num_heads
            ),
        }
        if self.device.type == "cuda":
            paths.update(self.triton_paths(None))
            if len(self.plan.blocks) > 1:
                paths["region-copy"] = self.region_copy
                paths["region-scatter-triton"] = lambda: queue_scatter_region(
                    self.staging, 0, self.plan, self.dst, self.dst_slots
                )
        return paths

    def triton_paths(self, cfg: LaunchConfig | None) -> dict[str, Path]:
        from kvstage.dataplane import kernels

        t, b = self.block.transfer, self.block
        src, dst = kernels.address_of(self.src), kernels.address_of(self.dst)
        assert src is not None and dst is not None  # a KVPool is always served
        return {
            "gather-triton": lambda: src.gather(
                self.src_slots, t.src_head_start, t.num_heads, self.staging, b.offset, cfg
            ),
            "scatter-triton": lambda: dst.scatter(
                self.staging, b.offset, self.dst_slots, t.dst_head_start, t.num_heads, cfg
            ),
        }


def _runs(setup: Setup, paths: dict[str, Path], runs: int, repeats: int, batch: int) -> Iterator[dict[str, float]]:
    """Per run: seconds of each path, interleaved, after fresh pages and two warm-up calls of each."""
    for _ in range(runs):
        setup.draw()
        for fn in paths.values():
            fn()
            fn()
        yield {name: _seconds(setup.device, fn, repeats, batch) for name, fn in paths.items()}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def measure(case: Case, device: torch.device, runs: int, repeats: int, batch: int) -> dict[str, object]:
    setup = Setup(case, device)
    samples = list(_runs(setup, setup.paths(), runs, repeats, batch))
    nbytes = setup.block.nbytes
    print(f"{case}: block {nbytes / 2**20:.0f} MiB, {runs} runs x median of {repeats}, {batch} call(s) per timing")
    print(f"{'path':>22}  {'GB/s median (min-max)':>26}  {'x copy median (min-max)':>26}")
    for name in samples[0]:
        region = name.startswith("region-")  # measured against the copy of the whole region
        size, copy = (setup.plan.total_bytes, "region-copy") if region else (nbytes, "copy")
        gbps = [size / s[name] / 1e9 for s in samples]
        ratio = [s[copy] / s[name] for s in samples]
        print(f"{name:>22}  {_spread(gbps):>26}  {'' if name == copy else _spread(ratio):>26}")
    return {"case": str(case), "block_bytes": nbytes, "region_bytes": setup.plan.total_bytes, "seconds": samples}


def sweep(case: Case, device: torch.device, runs: int, repeats: int, batch: int) -> dict[str, object]:
    """Triton paths over `SWEEP_TILE_BYTES` x `SWEEP_WARPS`, each against the copy in the same run."""
    from kvstage.dataplane import kernels

    setup = Setup(case, device)
    paged, heads = kernels.address_of(setup.src), setup.block.transfer.num_heads
    assert paged is not None
    paths: dict[str, Path] = {"copy": setup.copy}
    for tile, warps in itertools.product(SWEEP_TILE_BYTES, SWEEP_WARPS):
        config = kernels.default_config(paged, heads, tile, warps)
        for name, fn in setup.triton_paths(config).items():
            paths[f"{name} t{config.block_tokens} w{warps}"] = fn
    samples = list(_runs(setup, paths, runs, repeats, batch))
    print(f"sweep {case}")
    for name in paths:
        if name != "copy":
            print(f"{name:>28}  {_spread([s['copy'] / s[name] for s in samples])} x copy")
    return {"case": str(case), "sweep": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--page-size", type=int, nargs="+", default=[16])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--tp", nargs="+", default=["4:2"], help="prefill:decode TP pairs")
    parser.add_argument("--model", default="L32xH8xD128", help="layers x KV heads x head_dim (Llama-3-8B)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1, help="calls per timing (1: each call alone)")
    parser.add_argument("--sweep", action="store_true", help="time the Triton paths over launch configurations")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = re.fullmatch(r"L(\d+)xH(\d+)xD(\d+)", args.model)
    if model is None:
        parser.error(f"--model {args.model!r} is not of the form L32xH8xD128")
    layers, heads, head_dim = (int(x) for x in model.groups())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__} date={time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    results = []
    for tokens, page, dtype, tp in itertools.product(args.tokens, args.page_size, args.dtype, args.tp):
        p, d = (int(x) for x in tp.split(":"))
        case = Case(tokens, page, dtype, p, d, layers, heads, head_dim)
        results.append((sweep if args.sweep else measure)(case, device, args.runs, args.repeats, args.batch))
    print(json.dumps({"device": name, "results": results}))


if __name__ == "__main__":
    main()
