"""One TP rank of a `kvstage bench` run, in its own process: the engine side of a prefill or a decode rank.

Owns, per rank: the KV pool (on the CPU, or on a GPU with `--device cuda`; every page held by the "engine" for
the whole run; each request slot uses a seeded random permutation of pages, so copies are scattered as in a real
pool), the rank's runtime agent (the staged path), and what the two baselines need:

- decode: `target`, a region laid out exactly like its KV pool, allocated from the agent's transport (on the
  rank's GPU where the backend moves GPU memory, cuda_ipc and nixl), which the per-slice writes and the raw bulk
  writes land in (byte offsets from `PoolGeometry`, so a slice lands where it would in a real pool);
- prefill: a second transport of the same backend (the agent polls its own) with the KV pool registered as a source
  (a host copy of a GPU pool, unless the backend moves GPU memory); per request slot, the per-slice descriptors of
  every head transfer it owns (`plan_direct_slices`, one contiguous write per row where a slice is strided, because
  no backend writes strided), and the raw bulk writes per (this rank, decode rank) pair: its bytes as
  `BenchConfig.raw_writes_per_pair` contiguous writes in flight at once.

The parent (`kvstage.bench.runner`) drives it with commands over a private pipe; each reply carries the
`time.monotonic()` stamps (CLOCK_MONOTONIC, shared by every process of the host) the parent turns into
non-overlapping wall time. Prefill fills its pool with seeded bytes per global head; digests taken on both sides
prove that every path moved the same bytes.

Invariants: every wait has a deadline; a failed room or transfer is an error sent back with its reason, never a
number; a worker that hits an error reports it and exits non-zero. Called by `kvstage.bench.runner` only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvstage.bench.config import BenchConfig
from kvstage.bench.stages import RankMark
from kvstage.dataplane import KVPool, PoolGeometry, plan_direct_slices
from kvstage.layout import HeadTransfer, ceil_div, heads_of_rank, plan_head_transfers, plan_staging
from kvstage.protocol import Limits, Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.data import (
    DataTransport,
    LocalRegion,
    RemoteRegion,
    Slice,
    TransportConfig,
    create_transport,
    decode_descriptor,
    encode_descriptor,
)
from kvstage.transport.data.loopback import wait_for

log = logging.getLogger(__name__)

PREFILL, DECODE = "P", "D"
#: Liveness for the bench's agents: generous, because the baselines saturate both cores for seconds.
BENCH_TIMING = Timing(heartbeat_s=0.5, dead_after_s=60.0, retry_initial_s=0.05, retry_max_s=1.0)
#: How often decode polls its agent for outcomes: the resolution of the staged path's end time, the same as the
#: baselines' completion polling (`wait_for`), so no path's clock stops later than another's.
DECODE_POLL_S = 0.0002
#: Prefill's outcomes only gate the next round, so it polls less often and leaves the CPU to the transfer.
PREFILL_POLL_S = 0.01
#: Chunk stamps each agent keeps (runtime/trace.py): several rounds' worth of the largest runs.
TRACE_MARKS = 1 << 18
#: The agent's threads whose CPU time each staged round reports, by the end of their names.
AGENT_THREADS = {"reactor cpu": "-reactor"}


class WorkerFailed(Exception):
    """A command could not be carried out (failed room, failed transfer, timeout); the message says why."""


def byte_view(pool: KVPool) -> torch.Tensor:
    """`[2, L, slots, heads, head_bytes]` uint8 view of a pool."""
    g = pool.geometry
    return pool.flat.view(2, pool.layout.num_layers, g.num_slots, pool.num_heads, pool.layout.head_bytes)


def copy_threads(config: BenchConfig) -> int:
    """torch threads per rank process: with host pools, its share of the host's cores (gathers and scatters run on
    them); with GPU pools one, since the copies run on the GPU and its copy engines."""
    if config.device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // (config.prefill_tp + config.decode_tp))


def pool_device(config: BenchConfig, role: str, rank: int) -> str:
    """The rank's pool device: "cpu", or a GPU: prefill ranks first, then decode ranks, round robin over the host's
    GPUs, so the two instances get GPUs of their own where the host has enough."""
    if config.device == "cpu":
        return "cpu"
    slot = rank if role == PREFILL else config.prefill_tp + rank
    return f"cuda:{slot % torch.cuda.device_count()}"


def slot_pages(config: BenchConfig, role: str, rank: int) -> list[list[int]]:
    """Pages of each request slot: a seeded permutation of the whole pool, cut into slots."""
    gen = torch.Generator().manual_seed(config.seed * 31 + (0 if role == PREFILL else 1) * 1009 + rank)
    perm = torch.randperm(config.pool_pages, generator=gen).tolist()
    n = config.pages_per_request
    return [perm[slot * n : (slot + 1) * n] for slot in range(config.concurrency)]


def head_kv(config: BenchConfig, slot: int, head: int) -> torch.Tensor:
    """Seeded bytes of one global head of one request slot: uint8 `[2, L, tokens, head_bytes]`."""
    layout = config.layout
    gen = torch.Generator().manual_seed(config.seed * 7919 + slot * 131 + head)
    shape = (2, layout.num_layers, config.tokens, layout.head_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().contiguous().numpy().tobytes()).hexdigest()


def head_digests(config: BenchConfig, pool: KVPool, heads: range, pages: list[int]) -> dict[int, str]:
    """SHA-256 of tokens [0, tokens) of each held global head, as stored in `pool`."""
    landed = byte_view(pool).index_select(2, pool.slot_indices(pages, 0, config.tokens))
    return {head: sha(landed[:, :, :, i]) for i, head in enumerate(heads)}


def since(before: dict[str, float], after: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """Per-stage seconds between two `stage_seconds` readings."""
    return tuple((stage, after[stage] - before[stage]) for stage in after)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's reactors (one agent per bench rank process), by AGENT_THREADS."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        for label, suffix in AGENT_THREADS.items():
            if thread.ident is not None and thread.name.startswith("kvstage-") and thread.name.endswith(suffix):
                out[label] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return out


def wait_until(at: float) -> float:
    """Sleep until monotonic time `at`; returns the time it woke."""
    delay = at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    return time.monotonic()


@dataclass(frozen=True, slots=True)
class Timed:
    """One measured run on one rank: first submission, last completion, transfer operations issued, and (staged
    path) the seconds this rank's agent spent in each stage: "gather" or "scatter" on its reactor, "transfer"
    with at least one write in flight, and the CPU seconds of its threads (AGENT_THREADS); and its chunk marks."""

    start: float
    end: float
    ops: int
    busy: tuple[tuple[str, float], ...] = ()
    marks: tuple[RankMark, ...] = ()


class _Rank:
    """Shared parts of both roles: config, pool with its slot pages, agent, baseline transport."""

    role: str

    def __init__(self, config: BenchConfig, rank: int, bootstrap: str) -> None:
        self.config = config
        self.rank = rank
        self.tp = config.prefill_tp if self.role == PREFILL else config.decode_tp
        self.heads = heads_of_rank(config.layout.num_kv_heads, self.tp, rank)
        device = pool_device(config, self.role, rank)
        self.pool = KVPool.for_rank(config.layout, self.tp, rank, config.pool_pages, device)
        self.pool.allocator.allocate(config.pool_pages, owner="engine")
        self.pages = slot_pages(config, self.role, rank)
        self.bootstrap = bootstrap

    agent: DecodeAgent | PrefillAgent

    def agent_config(self) -> AgentConfig:
        """This rank's agent configuration, before the role's memory sizes (ring or staging) are set."""
        return AgentConfig(
            instance=self.role,
            rank=self.rank,
            tp_size=self.tp,
            layout=self.config.layout,
            bootstrap=self.bootstrap,
            transport=TransportConfig(backend=self.config.backend),
            timing=BENCH_TIMING,
            # prefill may ask for as many chunks ahead as a decode ring holds (the default window is 4)
            limits=Limits(max_chunks_ahead=max(Limits().max_chunks_ahead, self.config.ring_chunks)),
            chunk_tokens=self.config.chunk_tokens,
            writes_per_peer=self.config.writes_per_peer,
            trace_chunks=TRACE_MARKS,
        )

    def close(self) -> None:
        self.agent.close()

    def stage_seconds(self) -> dict[str, float]:
        """Seconds this rank's agent has spent so far in each stage of the staged path."""
        m = self.agent.metrics
        copy = "gather" if self.role == PREFILL else "scatter"
        seconds = {copy: m.value("kvstage_copy_seconds_sum", kind=copy)}
        if self.role == PREFILL:
            seconds["transfer"] = m.value("kvstage_transfer_busy_seconds_total")
        return seconds | thread_cpu_seconds()

    def drain_marks(self) -> tuple[RankMark, ...]:
        """The chunk marks this rank's agent made since the last call."""
        local = self.agent.peer_id
        return tuple((local, m.room, m.chunk, m.stage, m.at, m.peer) for m in self.agent.trace.drain())

    def wait_rooms(self, rooms: list[int], poll_s: float) -> float:
        """Poll the agent every `poll_s` until every room ended; returns when the last one was seen to end.

        Failed rooms raise."""
        pending = set(rooms)
        last = time.monotonic()
        deadline = last + self.config.timeout_s
        while pending:
            for outcome in self.agent.poll():
                if outcome.room not in pending:
                    continue
                if not outcome.ok:
                    raise WorkerFailed(f"{self.agent.peer_id}: room {outcome.room} failed: {outcome.reason}")
                pending.discard(outcome.room)
                last = time.monotonic()
            if pending:
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"{self.agent.peer_id}: rooms {sorted(pending)} still open after timeout")
                time.sleep(poll_s)
        return last


class DecodeRank(_Rank):
    """A decode rank: expects rooms through its agent; owns the baseline target region.

    The target is allocated from the agent's own transport: a reader never polls its transport (writes are
    one-sided), so sharing it is safe, and each decode rank runs one transport, as in production.
    """

    role = DECODE

    def __init__(self, config: BenchConfig, rank: int, bootstrap: str) -> None:
        super().__init__(config, rank, bootstrap)
        self.decode_agent = DecodeAgent(replace(self.agent_config(), ring_bytes=config.ring_bytes(rank)), self.pool)
        self.decode_agent.start()
        self.agent = self.decode_agent
        transport = self.agent.transport
        self.target: LocalRegion = transport.allocate(
            self.pool.geometry.nbytes, device=transport.staging_device(self.pool.device)
        )

    def info(self) -> dict[str, Any]:
        return {"pages": self.pages, "target": encode_descriptor(self.agent.transport.export(self.target))}

    def wait(self, rooms: list[int]) -> Timed:
        before = self.stage_seconds()
        end = self.wait_rooms(rooms, DECODE_POLL_S)
        return Timed(end, end, 0, since(before, self.stage_seconds()), self.drain_marks())

    def expect(self, rooms: list[tuple[int, int]]) -> None:
        peers = tuple(peer_id(PREFILL, r) for r in range(self.config.prefill_tp))
        for room, slot in rooms:
            self.decode_agent.expect_room(
                room, peers, self.config.tokens, 0, tuple(self.pages[slot]), self.config.timeout_s
            )

    def verify(self) -> dict[str, Any]:
        """Digests of what the staged path landed, and whether the per-slice path landed the same bytes."""
        target = self.target.tensor.view(byte_view(self.pool).shape)
        same = True
        for pages in self.pages:
            slots = self.pool.slot_indices(pages, 0, self.config.tokens)
            landed = byte_view(self.pool).index_select(2, slots).cpu()
            same = same and torch.equal(landed, target.index_select(2, slots.to(target.device)).cpu())
        return {
            "staged_equals_slice": same,
            "heads": [head_digests(self.config, self.pool, self.heads, pages) for pages in self.pages],
        }

    def digest(self, ranges: list[tuple[int, int]]) -> list[str]:
        return [sha(self.target.tensor[offset : offset + n]) for offset, n in ranges]


class PrefillRank(_Rank):
    """A prefill rank: fills its pool with seeded KV, attaches rooms to its agent, and runs both baselines."""

    role = PREFILL

    def __init__(self, config: BenchConfig, rank: int, bootstrap: str, decode_info: list[dict[str, Any]]) -> None:
        super().__init__(config, rank, bootstrap)
        # bounded like the agents' transports (AgentConfig.bounded_transport), so raw and per-slice pay the same
        # write pieces as the staged path
        bounded = TransportConfig(backend=config.backend, max_write_s=BENCH_TIMING.max_write_s)
        self.baseline: DataTransport = create_transport(bounded)
        self.digests = [self._fill(slot) for slot in range(config.concurrency)]
        # the baselines' source: the pool itself (host, or GPU where the backend moves GPU memory), or a host copy
        # of a GPU pool (same bytes, same offsets)
        in_place = self.baseline.staging_device(self.pool.device) == self.pool.device
        self.source = self.baseline.register(self.pool.flat if in_place else self.pool.flat.cpu())
        self.transfers = [
            t
            for t in plan_head_transfers(config.layout.num_kv_heads, config.prefill_tp, config.decode_tp)
            if t.prefill_rank == rank
        ]
        self.remotes = {
            t.decode_rank: self.baseline.import_remote(decode_descriptor(decode_info[t.decode_rank]["target"]))
            for t in self.transfers
        }
        dst_pages = [info["pages"] for info in decode_info]
        self.slices = [self._slices(slot, dst_pages) for slot in range(config.concurrency)]
        self.raw = [self._raw(slot) for slot in range(config.concurrency)]
        self.prefill_agent = PrefillAgent(
            replace(self.agent_config(), staging_bytes=config.staging_bytes(rank)), self.pool
        )
        self.prefill_agent.start()
        self.agent = self.prefill_agent

    def close(self) -> None:
        super().close()
        self.baseline.close()

    def _fill(self, slot: int) -> dict[int, str]:
        view = byte_view(self.pool)
        slots = self.pool.slot_indices(self.pages[slot], 0, self.config.tokens)
        for i, head in enumerate(self.heads):
            view[:, :, :, i].index_copy_(2, slots, head_kv(self.config, slot, head).to(self.pool.device))
        return head_digests(self.config, self.pool, self.heads, self.pages[slot])

    def _slices(self, slot: int, dst_pages: list[list[list[int]]]) -> list[tuple[RemoteRegion, list[Slice], int]]:
        """(remote, contiguous writes, slice descriptors) of every head transfer of this rank, for `slot`."""
        out = []
        for t in self.transfers:
            dst = PoolGeometry(self.config.layout, len(self._decode_heads(t)), self.config.pool_pages)
            copies = plan_direct_slices(
                self.pool.geometry, dst, t, self.pages[slot], dst_pages[t.decode_rank][slot], 0, self.config.tokens
            )
            out.append((self.remotes[t.decode_rank], [w for c in copies for w in c.runs()], len(copies)))
        return out

    def _decode_heads(self, t: HeadTransfer) -> range:
        return heads_of_rank(self.config.layout.num_kv_heads, self.config.decode_tp, t.decode_rank)

    def _raw(self, slot: int) -> list[tuple[int, RemoteRegion, Slice]]:
        """(decode rank, remote, write) of the bulk writes to each decode rank this rank feeds: its block's bytes,
        to where its block would go, as `raw_writes_per_pair` contiguous parts in flight at once."""
        out = []
        for t in self.transfers:
            plan = plan_staging(self.config.layout, self.config.prefill_tp, self.config.decode_tp, t.decode_rank,
                                self.config.tokens)  # fmt: skip
            block = plan.block_of(self.rank)
            src = min(slot * block.nbytes, self.pool.geometry.nbytes - block.nbytes)
            dst = slot * plan.total_bytes + block.offset
            out += [(t.decode_rank, self.remotes[t.decode_rank], (src + start, dst + start, n))
                    for start, n in split_evenly(block.nbytes, self.config.raw_writes_per_pair)]  # fmt: skip
        return out

    # ---- commands ------------------------------------------------------------------------------------------

    def staged(self, rooms: list[tuple[int, int]], start_at: float) -> Timed:
        """Announce rooms (the forward pass starts), then at `start_at` say their KV is ready; wait for outcomes."""
        for room, _ in rooms:
            self.prefill_agent.attach_room(room, self.config.tokens, self.config.decode_tp, self.config.timeout_s)
            self.prefill_agent.compute_scheduled(room, self.config.tokens)
        ops, before = self.agent.transport.ops_issued, self.stage_seconds()
        start = wait_until(start_at)
        for room, slot in rooms:
            self.prefill_agent.kv_ready(room, self.config.tokens, tuple(self.pages[slot]))
        end = self.wait_rooms([room for room, _ in rooms], PREFILL_POLL_S)
        self.agent.wait_quiescent(self.config.timeout_s)
        busy = since(before, self.stage_seconds())
        return Timed(start, end, self.agent.transport.ops_issued - ops, busy, self.drain_marks())

    def per_slice(self, slots: list[int], start_at: float) -> Timed:
        batch = self.config.batch_slices
        jobs = [(remote, writes[i : i + batch]) for s in slots for remote, writes, _ in self.slices[s]
                for i in range(0, len(writes), batch)]  # fmt: skip
        return self._timed(start_at, lambda: [self.baseline.write_batch(self.source, r, w) for r, w in jobs])

    def raw_bulk(self, slots: list[int], start_at: float) -> Timed:
        jobs = [job for s in slots for job in self.raw[s]]
        return self._timed(
            start_at, lambda: [self.baseline.write(self.source, w[0], r, w[1], w[2]) for _, r, w in jobs]
        )

    def _timed(self, start_at: float, submit: Callable[[], list[int]]) -> Timed:
        ops = self.baseline.ops_issued
        start = wait_until(start_at)
        done = wait_for(self.baseline, submit(), self.config.timeout_s)
        end = time.monotonic()
        failed = [c for c in done.values() if not c.ok]
        if failed:
            raise WorkerFailed(f"prefill rank {self.rank}: write failed: {failed[0].reason}")
        return Timed(start, end, self.baseline.ops_issued - ops)

    def info(self) -> dict[str, Any]:
        return {
            "digests": self.digests,
            "slice_descriptors": [sum(n for _, _, n in per_slot) for per_slot in self.slices],
            "raw": [
                [(decode_rank, w[1], w[2], sha(self.source.tensor[w[0] : w[0] + w[2]])) for decode_rank, _, w in
                 self.raw[slot]]
                for slot in range(self.config.concurrency)
            ],
        }  # fmt: skip


def split_evenly(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of `parts` consecutive pieces of `nbytes` bytes, as equal as 64-byte alignment allows."""
    step = ceil_div(ceil_div(nbytes, parts), 64) * 64
    return [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]


def worker_main(
    conn: Connection, role: str, rank: int, config: BenchConfig, bootstrap: str, decode_info: list[dict[str, Any]]
) -> None:
    """Process body: build the rank, report `("ready", info)`, then answer commands until "stop"."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s bench-{role}{rank} %(name)s %(message)s")
    torch.set_num_threads(copy_threads(config))
    try:
        node: DecodeRank | PrefillRank = (
            DecodeRank(config, rank, bootstrap) if role == DECODE else PrefillRank(config, rank, bootstrap, decode_info)
        )
        conn.send(("ready", node.info()))
        _serve(conn, node)
    except BaseException as exc:  # reported to the parent, then re-raised so the process exits non-zero
        conn.send(("error", f"{role}{rank}: {type(exc).__name__}: {exc}"))
        raise


def _serve(conn: Connection, node: DecodeRank | PrefillRank) -> None:
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                conn.send(("ok", None))
                return
            conn.send(("ok", _dispatch(node, command, args)))
    finally:
        node.close()


def _dispatch(node: DecodeRank | PrefillRank, command: str, args: list[Any]) -> Any:
    if isinstance(node, DecodeRank):
        if command == "expect":
            return node.expect(args[0])
        if command == "wait":
            return node.wait(args[0])
        if command == "verify":
            return node.verify()
        if command == "digest":
            return node.digest(args[0])
    else:
        if command == "staged":
            return node.staged(*args)
        if command == "slice":
            return node.per_slice(*args)
        if command == "raw":
            return node.raw_bulk(*args)
    raise WorkerFailed(f"{node.role}{node.rank}: unknown bench command {command!r}")
