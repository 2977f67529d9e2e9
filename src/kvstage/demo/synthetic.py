"""`kvstage demo --synthetic`: an end-to-end handoff through the real runtime agents, in one process, with no vLLM
and no model, and a printed report.

Owns the demo scenario and its report. It starts a `BootstrapServer` (or uses the directory `bootstrap` names, such
as an etcd), prefill `PrefillAgent`s and decode
`DecodeAgent`s (default: TP=4 to TP=2, a small llama-like layout) in this process, on the embedded `local`
backend: control messages go over ZeroMQ sockets, KV bytes through shared-memory staging rings small enough to
wrap. There is no model: seeded random KV, written into fragmented prefill pools, stands in for the forward pass.
A few requests of different sizes are handed off (one with a decode-side cached prefix), plus one that prefill
computes only in part and decode then aborts, to show an explicit failure and its cleanup.

Invariants it verifies and reports: every succeeded room's decode pool bytes equal, on every decode rank, the
prefill pools' KV of the heads that rank owns; the aborted room fails on every rank, "aborted by decode" (or, on a
decode rank that heard of the abort from a prefill rank before its own engine's call reached it, "aborted by
prefill"), and decode gets its pages back; bytes and bulk writes equal what the staging plans predict; every ring
is empty, every page returned, no frame rejected, no internal error, no shared-memory segment left. The agents and the
bootstrap are closed on every path. Called by `kvstage demo --synthetic` (cli.py) and tests/runtime/test_demo.py.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from rich.console import Console

from kvstage.dataplane import KVPool, plan_direct_slices
from kvstage.demo.summary import summary_table
from kvstage.layout import ChunkGrid, KVLayout, heads_of_rank, pages_for, plan_head_transfers, plan_staging
from kvstage.protocol.reasons import ABORTED_BY_PREFILL
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, RoomOutcome
from kvstage.runtime.agent import BaseAgent
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.data import TransportConfig

_Agent = TypeVar("_Agent", bound=BaseAgent)

ABORTED_BY_DECODE = "aborted by decode"


@dataclass(frozen=True, slots=True)
class DemoRequest:
    num_tokens: int
    prefix_tokens: int = 0  # tokens already cached on decode; only the suffix moves
    abort_after: int | None = None  # prefill computes only these tokens, then decode aborts the room


#: A small llama-like layout: 8 KV heads of 128 in bf16 (as Llama-3-8B), fewer layers to stay fast on CPU.
DEMO_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)

DEMO_REQUESTS = (
    DemoRequest(700),
    DemoRequest(1500, prefix_tokens=256),
    DemoRequest(333),
    DemoRequest(48),
    DemoRequest(900, abort_after=256),
)


OUTCOME_GRACE_S = 5.0
"""How long past a room's deadline the demo still polls: an agent fails an expired room on its next turn, and a
wait that ends exactly at the deadline can miss that outcome (and then keep the room's pages)."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    layout: KVLayout = DEMO_LAYOUT
    prefill_tp: int = 4
    decode_tp: int = 2
    chunk_tokens: int = 128
    ring_chunks: float = 2.5  # each decode ring holds this many full-chunk regions, so it wraps
    requests: tuple[DemoRequest, ...] = DEMO_REQUESTS
    seed: int = 0
    timeout_s: float = 60.0  # room deadline; the demo waits OUTCOME_GRACE_S longer for the outcomes it forces
    bootstrap: str = ""  # the directory to use (tcp:// or etcd://); "" starts a `BootstrapServer` of its own


@dataclass
class RoomResult:
    room: int
    request: DemoRequest
    ok: bool = False  # succeeded on every rank
    reasons: tuple[str, ...] = ()  # distinct failure reasons over all ranks ("no outcome" if one never came)
    verified: bool = False  # succeeded rooms: bit-exact on every decode rank; the aborted one: failed as expected
    pages_back: bool = False  # decode got its pages back in the failed outcome (aborted room only)


@dataclass
class DemoReport:
    config: DemoConfig
    rooms: list[RoomResult] = field(default_factory=list)
    bytes_moved: int = 0
    expected_bytes: int = 0
    staged_ops: int = 0
    expected_ops: int = 0
    direct_slices: int = 0
    direct_writes: int = 0
    chunks: int = 0
    ring_capacity: int = 0
    ring_high_water: int = 0
    expected_digest: str = ""
    decode_digest: str = ""
    rings_empty: bool = False
    pages_returned: bool = False
    rejected_frames: int = 0
    internal_errors: int = 0
    shm_left: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def counts_match(self) -> bool:
        return self.bytes_moved == self.expected_bytes and self.staged_ops == self.expected_ops

    @property
    def ok(self) -> bool:
        return (
            bool(self.rooms)
            and all(r.verified for r in self.rooms)
            and self.expected_digest == self.decode_digest
            and self.counts_match
            and self.rings_empty
            and self.pages_returned
            and self.rejected_frames == 0
            and self.internal_errors == 0
            and not self.shm_left
        )


@dataclass
class _Room:
    room: int
    request: DemoRequest
    prefill_pages: list[list[int]]
    decode_pages: list[list[int]]

    @property
    def computed(self) -> int:
        """Tokens prefill computes (and so hands off, from the decode prefix on)."""
        r = self.request
        return r.num_tokens if r.abort_after is None else r.abort_after


def _fragmented_pools(config: DemoConfig, tp: int, num_pages: int, gen: torch.Generator) -> list[KVPool]:
    """One pool per rank, its free list shuffled so that requests land on scattered pages."""
    pools = [KVPool.for_rank(config.layout, tp, rank, num_pages) for rank in range(tp)]
    for pool in pools:
        everything = pool.allocator.allocate(num_pages, owner="fragment")
        order = torch.randperm(num_pages, generator=gen).tolist()
        pool.allocator.free([everything[i] for i in order])
    return pools


def _digest(tensor: torch.Tensor) -> bytes:
    """A checksum of the tensor's bytes (bit-exact comparison without holding two copies side by side)."""
    return hashlib.blake2b(tensor.contiguous().view(torch.uint8).numpy().data, digest_size=16).digest()


def _read(pool: KVPool, pages: list[int], end: int) -> torch.Tensor:
    """Tokens [0, end) of `pool`'s heads: [2, layers, end, heads, head_dim]."""
    return pool.kv[:, :, pool.slot_indices(pages, 0, end)]


def _sample_sum(agent: BaseAgent, name: str) -> int:
    """Sum of every sample `name` of the agent's registry, over all label values (e.g. every reject reason)."""
    return int(sum(s.value for m in agent.metrics.registry.collect() for s in m.samples if s.name == name))


def _shm_segments(shm_dir: str) -> set[str]:
    return {p.name for p in Path(shm_dir).glob(f"kvstage-{os.getpid()}-*")}


class _Demo:
    def __init__(self, config: DemoConfig, stack: ExitStack) -> None:
        self.config = config
        self.report = DemoReport(config)
        self.gen = torch.Generator().manual_seed(config.seed)
        layout = config.layout
        num_pages = sum(pages_for(r.num_tokens, layout.page_size) for r in config.requests) + 8
        self.prefill_pools = _fragmented_pools(config, config.prefill_tp, num_pages, self.gen)
        self.decode_pools = _fragmented_pools(config, config.decode_tp, num_pages, self.gen)
        full = max(
            plan_staging(layout, config.prefill_tp, config.decode_tp, d, config.chunk_tokens).total_bytes
            for d in range(config.decode_tp)
        )
        self.report.ring_capacity = int(full * config.ring_chunks)
        self.bootstrap = config.bootstrap or self._start_bootstrap(stack)
        self.decode = [self._start(stack, DecodeAgent, "D", r, pool) for r, pool in enumerate(self.decode_pools)]
        self.prefill = [self._start(stack, PrefillAgent, "P", r, pool) for r, pool in enumerate(self.prefill_pools)]
        self.prefill_peers = self.decode[0].connect("P", config.prefill_tp, timeout_s=30)
        self.outcomes: dict[str, dict[int, RoomOutcome]] = {a.peer_id: {} for a in self.agents}

    @staticmethod
    def _start_bootstrap(stack: ExitStack) -> str:
        server = BootstrapServer().start()
        stack.callback(server.close)
        return server.address

    @property
    def agents(self) -> list[BaseAgent]:
        return [*self.decode, *self.prefill]

    def _start(self, stack: ExitStack, cls: type[_Agent], instance: str, rank: int, pool: KVPool) -> _Agent:
        cfg = self.config
        agent_config = AgentConfig(
            instance=instance,
            rank=rank,
            tp_size=cfg.decode_tp if instance == "D" else cfg.prefill_tp,
            layout=cfg.layout,
            bootstrap=self.bootstrap,
            chunk_tokens=cfg.chunk_tokens,
            ring_bytes=self.report.ring_capacity,
            staging_bytes=self.report.ring_capacity,
        )
        agent = cls(agent_config, pool)
        agent.start()
        stack.callback(agent.close)
        return agent

    # ---- the scenario ------------------------------------------------------------------------------------

    def run(self) -> None:
        rooms = [self._admit(room, request) for room, request in enumerate(self.config.requests, start=1)]
        self._plan_counts(rooms)
        completing = [r for r in rooms if r.request.abort_after is None]
        aborted = [r for r in rooms if r.request.abort_after is not None]
        # the abort comes once the aborted room's computed chunks have landed (or a room already failed: then the
        # planned bytes will never all move)
        self._wait_for(completing, lambda: self._moved() >= self.report.expected_bytes or self._any_failed())
        for room in aborted:  # prefill computed only part of it; decode gives up on the room
            for agent in self.decode:
                agent.abort(room.room)
        self._wait_for(aborted, lambda: True)
        self.report.bytes_moved = self._moved()
        self.report.staged_ops = sum(_sample_sum(a, "kvstage_transfer_ops_total") for a in self.prefill)
        self._verify(rooms)
        self._release(rooms)
        # quiescent: nothing open, parked or in flight (so no prefill staging slot is held either)
        quiescent = [agent.wait_quiescent(5) for agent in self.agents]
        self.report.rings_empty = all(quiescent) and all(a.snapshot().ring_live_bytes == 0 for a in self.decode)
        self.report.ring_high_water = max(a.snapshot().ring_high_water for a in self.decode)
        self.report.pages_returned = all(not pool.allocator.leaked() for pool in self.prefill_pools + self.decode_pools)
        self.report.rejected_frames = sum(_sample_sum(a, "kvstage_rejected_frames_total") for a in self.agents)
        self.report.internal_errors = sum(_sample_sum(a, "kvstage_internal_errors_total") for a in self.agents)

    def _admit(self, room: int, request: DemoRequest) -> _Room:
        """Decode registers the room first (with its cached prefix in place), then prefill computes and hands off."""
        layout, cfg = self.config.layout, self.config
        npages = pages_for(request.num_tokens, layout.page_size)
        state = _Room(
            room,
            request,
            [pool.allocator.allocate(npages, owner=room) for pool in self.prefill_pools],
            [pool.allocator.allocate(npages, owner=room) for pool in self.decode_pools],
        )
        shape = (2, layout.num_layers, request.num_tokens, layout.num_kv_heads, layout.head_dim)
        kv = torch.randn(shape, generator=self.gen, dtype=self.prefill_pools[0].kv.dtype)  # the "forward pass"
        self._store(self.decode_pools, state.decode_pages, kv, request.prefix_tokens)  # decode's prefix cache hit
        for decode, pages in zip(self.decode, state.decode_pages, strict=True):
            decode.expect_room(
                room, self.prefill_peers, request.num_tokens, request.prefix_tokens, tuple(pages), cfg.timeout_s
            )
        self._store(self.prefill_pools, state.prefill_pages, kv, state.computed)
        for prefill, pages in zip(self.prefill, state.prefill_pages, strict=True):
            prefill.attach_room(room, request.num_tokens, cfg.decode_tp, cfg.timeout_s)
            prefill.compute_scheduled(room, state.computed)
            prefill.kv_ready(room, state.computed, tuple(pages))
        return state

    def _store(self, pools: list[KVPool], pages: list[list[int]], kv: torch.Tensor, end: int) -> None:
        """Write tokens [0, end) of `kv` into each rank's heads."""
        if end == 0:
            return
        for rank, pool in enumerate(pools):
            heads = heads_of_rank(self.config.layout.num_kv_heads, len(pools), rank)
            pool.kv[:, :, pool.slot_indices(pages[rank], 0, end)] = kv[:, :, :end, heads.start : heads.stop]

    def _plan_counts(self, rooms: list[_Room]) -> None:
        """What the plans predict: staged bytes and bulk writes, and the per-slice count for the same tokens."""
        cfg, report = self.config, self.report
        grid = ChunkGrid(cfg.chunk_tokens, cfg.layout.page_size)
        transfers = plan_head_transfers(cfg.layout.num_kv_heads, cfg.prefill_tp, cfg.decode_tp)
        for state in rooms:
            start = state.request.prefix_tokens
            for chunk in grid.chunks(state.computed, start):
                report.chunks += 1
                for d in range(cfg.decode_tp):
                    blocks = plan_staging(cfg.layout, cfg.prefill_tp, cfg.decode_tp, d, chunk.num_tokens).blocks
                    report.expected_ops += len(blocks)
                    report.expected_bytes += sum(block.nbytes for block in blocks)
            for t in transfers:
                src, dst = self.prefill_pools[t.prefill_rank], self.decode_pools[t.decode_rank]
                slices = plan_direct_slices(
                    src.geometry,
                    dst.geometry,
                    t,
                    state.prefill_pages[t.prefill_rank],
                    state.decode_pages[t.decode_rank],
                    start,
                    state.computed,
                )
                report.direct_slices += len(slices)
                report.direct_writes += sum(s.writes for s in slices)

    def _any_failed(self) -> bool:
        return any(not o.ok for got in self.outcomes.values() for o in got.values())

    def _moved(self) -> int:
        return sum(agent.metrics.bytes_moved() for agent in self.prefill)

    def _wait_for(self, rooms: list[_Room], also: Callable[[], bool]) -> None:
        """Poll every agent (as each engine's scheduler would) until each room has an outcome on every rank and
        `also()` holds, or the timeout passes."""
        wanted = {state.room for state in rooms}
        deadline = time.monotonic() + self.config.timeout_s + OUTCOME_GRACE_S
        while time.monotonic() < deadline:
            for agent in self.agents:
                self.outcomes[agent.peer_id].update((o.room, o) for o in agent.poll())
            if all(wanted <= got.keys() for got in self.outcomes.values()) and also():
                return
            time.sleep(0.002)

    def _verify(self, rooms: list[_Room]) -> None:
        """Each room's outcomes on every rank, and for succeeded rooms each decode rank's bytes against prefill's."""
        expected, got = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        for state in rooms:
            result = RoomResult(state.room, state.request)
            outcomes = [self.outcomes[a.peer_id].get(state.room) for a in self.agents]
            result.ok = all(o is not None and o.ok for o in outcomes)
            failed = {"no outcome" if o is None else o.reason for o in outcomes if o is None or not o.ok}
            result.reasons = tuple(sorted(failed))
            if state.request.abort_after is None:
                if result.ok:
                    want = [_digest(t) for t in self._expected(state)]
                    have = [_digest(t) for t in self._landed(state)]
                    for digest, mine in zip(want, have, strict=True):
                        expected.update(digest)
                        got.update(mine)
                    result.verified = want == have
            else:
                decode_out = [self.outcomes[a.peer_id].get(state.room) for a in self.decode]
                result.pages_back = all(
                    o is not None and sorted(o.pages) == sorted(pages)
                    for o, pages in zip(decode_out, state.decode_pages, strict=True)
                )
                told = set(result.reasons)  # a decode rank may hear of the abort from prefill before its own call
                as_told = ABORTED_BY_DECODE in told <= {ABORTED_BY_DECODE, ABORTED_BY_PREFILL}
                result.verified = as_told and result.pages_back
            self.report.rooms.append(result)
        self.report.expected_digest = expected.hexdigest()
        self.report.decode_digest = got.hexdigest()

    def _expected(self, state: _Room) -> list[torch.Tensor]:
        """Per decode rank, the prefill pools' KV of the heads that rank owns (prefix: decode's own cache)."""
        cfg, n = self.config, state.request.num_tokens
        layout = cfg.layout
        full = torch.empty(
            (2, layout.num_layers, n, layout.num_kv_heads, layout.head_dim), dtype=self.prefill_pools[0].kv.dtype
        )
        for rank, pool in enumerate(self.prefill_pools):
            heads = heads_of_rank(layout.num_kv_heads, cfg.prefill_tp, rank)
            full[:, :, :, heads.start : heads.stop] = _read(pool, state.prefill_pages[rank], n)
        out = []
        for rank in range(cfg.decode_tp):
            heads = heads_of_rank(layout.num_kv_heads, cfg.decode_tp, rank)
            out.append(full[:, :, :, heads.start : heads.stop])
        return out

    def _landed(self, state: _Room) -> list[torch.Tensor]:
        n = state.request.num_tokens
        return [_read(pool, pages, n) for pool, pages in zip(self.decode_pools, state.decode_pages, strict=True)]

    def _release(self, rooms: list[_Room]) -> None:
        """What each engine does once a room has its outcome: free the pages (decode: after generation)."""
        for state in rooms:
            for prefill, pool, pages in zip(self.prefill, self.prefill_pools, state.prefill_pages, strict=True):
                if state.room in self.outcomes[prefill.peer_id]:
                    pool.allocator.free(pages)
            for decode, pool, pages in zip(self.decode, self.decode_pools, state.decode_pages, strict=True):
                outcome = self.outcomes[decode.peer_id].get(state.room)
                if outcome is not None:
                    pool.allocator.free(pages if outcome.ok else outcome.pages)


def run_demo(config: DemoConfig | None = None) -> DemoReport:
    """Run the handoff through the agents, verify it, close everything, and return the report."""
    config = config or DemoConfig()
    shm_dir = TransportConfig().shm_dir
    before = _shm_segments(shm_dir)
    start = time.perf_counter()
    with ExitStack() as stack:  # closes every agent started so far, then the bootstrap, also on error
        demo = _Demo(config, stack)
        demo.run()
    report = demo.report
    report.shm_left = tuple(sorted(_shm_segments(shm_dir) - before))
    report.seconds = time.perf_counter() - start
    return report


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _verdict(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]NO[/red]"


def _describe(request: DemoRequest) -> str:
    text = f"{request.num_tokens} tok"
    if request.prefix_tokens:
        text += f" ({request.prefix_tokens} cached on decode)"
    if request.abort_after is not None:
        text += f" (prefill computes {request.abort_after}, then decode aborts)"
    return text


def _room_line(result: RoomResult) -> str:
    if result.ok:
        check = "bit-exact on every decode rank" if result.verified else "[red]bytes differ[/red]"
        return f"[green]ok[/green], {check}"
    reasons = ", ".join(result.reasons)
    if result.verified:
        return f"[yellow]failed[/yellow] as intended: {reasons} (decode pages returned)"
    return f"[red]failed[/red]: {reasons}" + ("" if result.request.abort_after is None else " (unexpected)")


def print_report(report: DemoReport, console: Console | None = None) -> None:
    """Print the report as a short rich table."""
    console = console or Console()
    cfg = report.config
    layout = cfg.layout
    console.print(
        "[bold]kvstage demo[/bold]: an [bold]end-to-end handoff through the real agents[/bold] "
        "(PrefillAgent -> DecodeAgent) over ZeroMQ and shared memory, in one process, with no model "
        "(seeded random KV stands in for the forward pass)."
    )
    through = cfg.decode_tp * report.ring_capacity
    rooms = [(f"room {r.room}", f"{_describe(r.request)}: {_room_line(r)}") for r in report.rooms]
    rows = [
        (
            "layout",
            f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x {layout.head_dim}, {layout.dtype}, "
            f"page {layout.page_size}",
        ),
        (
            "handoff",
            f"prefill TP={cfg.prefill_tp} -> decode TP={cfg.decode_tp}, chunk {cfg.chunk_tokens} tokens, "
            f"backend local (shared memory), control over ZeroMQ, directory {cfg.bootstrap or 'bootstrap in-process'}",
        ),
        *rooms,
        (
            "bytes moved",
            f"{_mib(report.bytes_moved)} in {report.chunks} chunks (plan: {_mib(report.expected_bytes)})",
        ),
        (
            "transfer ops",
            f"{report.staged_ops} staged bulk writes (plan: {report.expected_ops}) vs {report.direct_slices} "
            f"per-slice ops ({report.direct_writes} contiguous writes) for the same tokens = "
            f"{report.direct_slices / max(1, report.staged_ops):.0f}x fewer",
        ),
        (
            "staging rings",
            f"{_mib(report.ring_capacity)} per decode rank, wrapped: ~{report.bytes_moved / max(1, through):.0f}x "
            f"its size passed through; granted high water {_mib(report.ring_high_water)} (over-committed, each "
            "region written only once free)",
        ),
        ("checksum decode", report.decode_digest),
        (
            "checksum prefill",
            f"{report.expected_digest} {_verdict(report.expected_digest == report.decode_digest)}",
        ),
        ("counts match plan", _verdict(report.counts_match)),
        ("rings empty at end", f"{_verdict(report.rings_empty)} (decode rings; prefill staging idle)"),
        ("pages all returned", f"{_verdict(report.pages_returned)} (prefill and decode)"),
        ("rejected frames", f"{report.rejected_frames} {_verdict(report.rejected_frames == 0)}"),
        ("internal errors", f"{report.internal_errors} {_verdict(report.internal_errors == 0)}"),
        ("shared memory freed", _verdict(not report.shm_left) + "".join(f" {n}" for n in report.shm_left)),
        ("wall time", f"{report.seconds:.2f} s (agents started and closed)"),
    ]
    console.print(summary_table(rows))
    console.print("[bold green]OK: bit-exact[/bold green]" if report.ok else "[bold red]FAILED[/bold red]")
