"""`kvstage demo`: an in-process CPU staging round trip with a printed report.

Owns the demo scenario and its report. Until the end-to-end demo (engine, control plane, transports) exists,
this runs the real data path inside one process: a small llama-like layout, prefill TP=4 to decode TP=2, a few
requests (one with a decode-side cached prefix), per-rank `KVPool`s with pages at scattered positions, and one
real `StagingRing` plus `StagingBuffer` per decode rank. For every chunk each writer gathers its block into its
own local staging, waits for `region_ready`, copies the block into the decode rank's ring region in one bulk
write (standing in for a transport), and decode scatters the region and frees it. The same requests are then
moved again through the direct per-slice path, for the operation count and a second bit-exact check.

Invariants it verifies and reports: each decode rank's pool equals the true KV of its heads bit for bit (both
paths), every ring is empty and every page returned at the end. Called by `kvstage demo` (cli.py) and tests.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from kvstage.dataplane import (
    KVPool,
    StagingBuffer,
    copy_direct,
    gather,
    plan_direct_slices,
    scatter_region,
    torch_dtype,
)
from kvstage.layout import Chunk, ChunkGrid, KVLayout, StagingPlan, heads_of_rank, plan_head_transfers, plan_staging
from kvstage.ring import Allocation, StagingRing, region_ready


@dataclass(frozen=True, slots=True)
class DemoRequest:
    num_tokens: int
    prefix_tokens: int = 0  # tokens already cached on decode; only the suffix moves


#: A small llama-like layout: 8 KV heads of 128 in bf16 (as Llama-3-8B), fewer layers to stay fast on CPU.
DEMO_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    layout: KVLayout = DEMO_LAYOUT
    prefill_tp: int = 4
    decode_tp: int = 2
    chunk_tokens: int = 128
    ring_chunks: float = 2.5  # ring capacity, in regions of one full chunk, so the ring wraps
    window: int = 2  # chunks in flight per decode rank before the oldest is scattered
    requests: tuple[DemoRequest, ...] = (DemoRequest(700), DemoRequest(1500, prefix_tokens=256), DemoRequest(333))
    seed: int = 0


@dataclass
class DemoReport:
    config: DemoConfig
    bytes_moved: int = 0
    chunks: int = 0
    regions: int = 0
    staged_ops: int = 0
    direct_ops: int = 0
    direct_writes: int = 0
    max_round: int = 0
    ring_high_water: int = 0
    ring_capacity: int = 0
    expected_digest: str = ""
    staged_digest: str = ""
    direct_digest: str = ""
    rings_empty: bool = False
    pages_returned: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        digests_match = self.expected_digest == self.staged_digest == self.direct_digest
        return digests_match and self.rings_empty and self.pages_returned


@dataclass
class _Request:
    spec: DemoRequest
    true_kv: torch.Tensor  # [2, L, tokens, H, head_dim]
    prefill_pages: list[list[int]]
    decode_pages: list[list[int]]


@dataclass(frozen=True, slots=True)
class _InFlight:
    allocation: Allocation
    plan: StagingPlan
    request: _Request
    chunk: Chunk


class _Side:
    """The pools of one TP group, each fragmented so that requests land on scattered pages."""

    def __init__(self, config: DemoConfig, tp: int, num_pages: int, gen: torch.Generator) -> None:
        self.pools = [KVPool.for_rank(config.layout, tp, rank, num_pages) for rank in range(tp)]
        for pool in self.pools:
            everything = pool.allocator.allocate(num_pages, owner="fragment")
            order = torch.randperm(num_pages, generator=gen).tolist()
            pool.allocator.free([everything[i] for i in order])


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Demo:
    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.report = DemoReport(config)
        self.gen = torch.Generator().manual_seed(config.seed)
        layout = config.layout
        pages_needed = sum(-(-r.num_tokens // layout.page_size) for r in config.requests)
        self.num_pages = pages_needed + 8
        self.grid = ChunkGrid(config.chunk_tokens, layout.page_size)
        full_region = plan_staging(layout, config.prefill_tp, config.decode_tp, 0, config.chunk_tokens).total_bytes
        capacity = int(full_region * config.ring_chunks)
        self.report.ring_capacity = capacity
        self.rings = [StagingRing(capacity, alignment=256) for _ in range(config.decode_tp)]
        self.buffers = [StagingBuffer(capacity) for _ in range(config.decode_tp)]
        self.local = StagingBuffer(full_region)  # a prefill writer's own staging, reused block after block

    def run(self) -> DemoReport:
        start = time.perf_counter()
        prefill = _Side(self.config, self.config.prefill_tp, self.num_pages, self.gen)
        decode = _Side(self.config, self.config.decode_tp, self.num_pages, self.gen)
        requests = [self._admit(i, spec, prefill, decode) for i, spec in enumerate(self.config.requests)]
        for request in requests:
            self._write(prefill.pools, request.prefill_pages, request, request.spec.num_tokens)  # prefill computes
            self._write(decode.pools, request.decode_pages, request, request.spec.prefix_tokens)  # decode's cache hit
        self._staged(requests, prefill, decode)
        self.report.staged_digest = self._decode_digest(requests, decode)
        self._direct(requests, prefill)
        self.report.expected_digest = _digest(
            [self._expected(r, rank) for r in requests for rank in self._decode_ranks]
        )
        for request in requests:
            for side, pages in ((prefill, request.prefill_pages), (decode, request.decode_pages)):
                for pool, held in zip(side.pools, pages, strict=True):
                    pool.allocator.free(held)
        self.report.rings_empty = all(ring.num_live == 0 and ring.live_bytes == 0 for ring in self.rings)
        self.report.pages_returned = all(not pool.allocator.leaked() for pool in prefill.pools + decode.pools)
        self.report.seconds = time.perf_counter() - start
        return self.report

    @property
    def _decode_ranks(self) -> range:
        return range(self.config.decode_tp)

    def _admit(self, index: int, spec: DemoRequest, prefill: _Side, decode: _Side) -> _Request:
        layout = self.config.layout
        shape = (2, layout.num_layers, spec.num_tokens, layout.num_kv_heads, layout.head_dim)
        true_kv = torch.randn(shape, generator=self.gen).to(torch_dtype(layout.dtype))
        pages = -(-spec.num_tokens // layout.page_size)
        return _Request(
            spec,
            true_kv,
            [pool.allocator.allocate(pages, owner=f"request-{index}") for pool in prefill.pools],
            [pool.allocator.allocate(pages, owner=f"request-{index}") for pool in decode.pools],
        )

    def _write(self, pools: list[KVPool], pages: list[list[int]], request: _Request, end: int) -> None:
        """Store tokens `[0, end)` of the request's true KV into each rank's heads of `pools`."""
        if end == 0:
            return
        for rank, pool in enumerate(pools):
            heads = heads_of_rank(self.config.layout.num_kv_heads, len(pools), rank)
            slots = pool.slot_indices(pages[rank], 0, end)
            pool.kv[:, :, slots] = request.true_kv[:, :, :end, heads.start : heads.stop]

    def _expected(self, request: _Request, rank: int) -> torch.Tensor:
        heads = heads_of_rank(self.config.layout.num_kv_heads, self.config.decode_tp, rank)
        return request.true_kv[:, :, :, heads.start : heads.stop]

    def _decode_digest(self, requests: list[_Request], decode: _Side) -> str:
        got = []
        for request in requests:
            for rank in self._decode_ranks:
                pool = decode.pools[rank]
                got.append(pool.kv[:, :, pool.slot_indices(request.decode_pages[rank], 0, request.spec.num_tokens)])
        return _digest(got)

    def _staged(self, requests: list[_Request], prefill: _Side, decode: _Side) -> None:
        in_flight: list[deque[_InFlight]] = [deque() for _ in self._decode_ranks]
        for request in requests:
            for chunk in self.grid.chunks(request.spec.num_tokens, request.spec.prefix_tokens):
                self.report.chunks += 1
                for rank in self._decode_ranks:
                    self._stage_chunk(request, chunk, rank, prefill, decode, in_flight[rank])
        for rank in self._decode_ranks:
            while in_flight[rank]:
                self._complete_oldest(rank, decode, in_flight[rank])
        self.report.ring_high_water = max(ring.high_water for ring in self.rings)

    def _stage_chunk(
        self, request: _Request, chunk: Chunk, rank: int, prefill: _Side, decode: _Side, queue: deque[_InFlight]
    ) -> None:
        cfg = self.config
        ring = self.rings[rank]
        plan = plan_staging(cfg.layout, cfg.prefill_tp, cfg.decode_tp, rank, chunk.num_tokens)
        allocation = ring.allocate(plan.total_bytes)
        self.report.regions += 1
        self.report.max_round = max(self.report.max_round, allocation.round)
        while not region_ready(allocation, ring.watermark):
            self._complete_oldest(rank, decode, queue)  # the watermark advances only when older regions free
        for block in plan.blocks:
            writer = block.prefill_rank
            transfer = block.transfer
            gather(
                prefill.pools[writer],
                request.prefill_pages[writer],
                chunk.start,
                chunk.end,
                transfer.src_head_start,
                transfer.num_heads,
                self.local.flat,
                0,
            )
            dst = allocation.offset + block.offset
            self.buffers[rank].flat[dst : dst + block.nbytes].copy_(self.local.flat[: block.nbytes])  # bulk write
            self.report.staged_ops += 1
            self.report.bytes_moved += block.nbytes
        queue.append(_InFlight(allocation, plan, request, chunk))
        if len(queue) > cfg.window:
            self._complete_oldest(rank, decode, queue)

    def _complete_oldest(self, rank: int, decode: _Side, queue: deque[_InFlight]) -> None:
        done = queue.popleft()
        pages = done.request.decode_pages[rank]
        scatter_region(
            self.buffers[rank].flat, done.allocation.offset, done.plan, decode.pools[rank], pages, done.chunk
        )
        if not self.rings[rank].free(done.allocation):
            raise RuntimeError(f"allocation {done.allocation} was freed twice")

    def _direct(self, requests: list[_Request], prefill: _Side) -> None:
        cfg = self.config
        fresh = _Side(cfg, cfg.decode_tp, self.num_pages, self.gen)
        direct_pages = [[pool.allocator.allocate(len(r.decode_pages[0])) for pool in fresh.pools] for r in requests]
        transfers = plan_head_transfers(cfg.layout.num_kv_heads, cfg.prefill_tp, cfg.decode_tp)
        got = []
        for request, pages in zip(requests, direct_pages, strict=True):
            self._write(fresh.pools, pages, request, request.spec.prefix_tokens)
            for t in transfers:
                src, dst = prefill.pools[t.prefill_rank], fresh.pools[t.decode_rank]
                slices = plan_direct_slices(
                    src.geometry,
                    dst.geometry,
                    t,
                    request.prefill_pages[t.prefill_rank],
                    pages[t.decode_rank],
                    request.spec.prefix_tokens,
                    request.spec.num_tokens,
                )
                self.report.direct_ops += copy_direct(src, dst, slices)
                self.report.direct_writes += sum(s.writes for s in slices)
            for rank in self._decode_ranks:
                pool = fresh.pools[rank]
                got.append(pool.kv[:, :, pool.slot_indices(pages[rank], 0, request.spec.num_tokens)])
        for pool, rank in zip(fresh.pools, self._decode_ranks, strict=True):
            pool.allocator.free([page for pages in direct_pages for page in pages[rank]])
        self.report.direct_digest = _digest(got)


def run_demo(config: DemoConfig | None = None) -> DemoReport:
    """Run the in-process round trip and return its report."""
    return _Demo(config or DemoConfig()).run()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def print_report(report: DemoReport, console: Console | None = None) -> None:
    """Print the report as a short rich table, with a plain statement of what was and was not exercised."""
    console = console or Console()
    cfg = report.config
    layout = cfg.layout
    console.print(
        "[bold]kvstage demo[/bold]: an [bold]in-process[/bold] CPU staging round trip. Prefill and decode pools, "
        "staging rings and copies are real; there is no engine, no control plane and no network transport yet "
        "(a local byte copy stands in for each bulk write)."
    )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    table.add_row(
        "layout",
        f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x {layout.head_dim}, {layout.dtype}, "
        f"page {layout.page_size}",
    )
    table.add_row(
        "handoff", f"prefill TP={cfg.prefill_tp} -> decode TP={cfg.decode_tp}, chunk {cfg.chunk_tokens} tokens"
    )
    requests = ", ".join(
        f"{r.num_tokens} tok" + (f" ({r.prefix_tokens} cached)" if r.prefix_tokens else "") for r in cfg.requests
    )
    table.add_row("requests", requests)
    table.add_row("bytes moved", _mib(report.bytes_moved))
    table.add_row("chunks", f"{report.chunks} ({report.regions} ring regions over {cfg.decode_tp} decode ranks)")
    table.add_row(
        "transfer ops",
        f"staged {report.staged_ops} bulk writes vs per-slice {report.direct_ops} slices "
        f"({report.direct_writes} contiguous writes) = {report.direct_ops / max(1, report.staged_ops):.0f}x fewer",
    )
    table.add_row(
        "staging rings",
        f"{_mib(report.ring_capacity)} each, reused up to round {report.max_round}, "
        f"live-bytes high water {_mib(report.ring_high_water)} (over-committed, gated by region_ready)",
    )
    staged_ok = report.staged_digest == report.expected_digest
    direct_ok = report.direct_digest == report.expected_digest
    table.add_row("checksum staged", f"{report.staged_digest} {_verdict(staged_ok)}")
    table.add_row("checksum per-slice", f"{report.direct_digest} {_verdict(direct_ok)}")
    table.add_row("expected", report.expected_digest)
    table.add_row("rings empty at end", _verdict(report.rings_empty))
    table.add_row("pages all returned", _verdict(report.pages_returned))
    table.add_row("time", f"{report.seconds:.2f} s")
    console.print(table)
    console.print("[bold green]OK: bit-exact[/bold green]" if report.ok else "[bold red]FAILED[/bold red]")


def _verdict(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]NO[/red]"
