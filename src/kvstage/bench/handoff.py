"""`kvstage bench --handoff`: what a user feels of the KV handoff (latency, CPU, engine interference).

Owns the handoff scenario end to end: `HandoffConfig`, the rank processes (one per prefill and decode rank, each
with a KV pool and a runtime agent), the parent's sequence and the arithmetic of `HandoffResult`. After one
untimed, verified warm-up room it measures, in this order:

1. isolated last-chunk handoff: one room at a time, its compute scheduled up front (grants come early, as during a
   forward pass), then `kv_ready` for each chunk's end, `gap_s` apart; a sample runs from the last `kv_ready` (the
   latest over prefill ranks) to decode's main thread seeing the outcome (the latest over decode ranks, polled
   every `SPIN_S`); the agents' chunk marks say where the last chunk's time went (`stage_offsets_ms`);
2. tail with 4 ready: the same, but the last `TAIL_CHUNKS` chunks become ready in one `kv_ready`;
3. CPU per chunk: per rank, over the rooms of (1), the CPU seconds of every thread but the bench's main thread,
   divided by the chunks the rank handled;
4. engine interference: decode rank 0's main thread runs a fixed step (`engine_step`) that also polls the agent and
   expects rooms, as a scheduler does: alone for `stream_s`, then while prefill streams rooms at `chunk_rate_hz`.

The rank code uses only the runtime's public API (`AgentConfig`, the agents' engine calls, `trace`, `close`),
`KVPool`, `BootstrapServer`, `TransportConfig`, `Timing`, `BenchConfig` and the pure bench/handoff_stats.py, so
that benchmarks/handoff_ab.py can run these two files against another ref's `kvstage`.

Invariants: every wait has a deadline; a failed room is a `HandoffError` with its reason, never a number; decode's
KV of the warm-up room equals prefill's, head by head (SHA-256); every rank imports the parent's `kvstage`; every
process started is stopped (or killed) on the way out. All processes share one host's `time.monotonic()`. Called
by the CLI (`kvstage bench --handoff`), tests and benchmarks/handoff_ab.py.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

import kvstage
from kvstage.bench.config import BenchConfig
from kvstage.bench.handoff_stats import (
    TAIL_CHUNKS,
    Mark,
    chunk_ends,
    cpu_per_chunk_ms,
    interference,
    latency_ms,
    stage_offsets_ms,
    stream_rooms,
    tail_ends,
)
from kvstage.dataplane import KVPool
from kvstage.errors import ConfigError, KVStageError
from kvstage.layout import heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.data import TransportConfig

PREFILL, DECODE = "P", "D"
#: Chunk marks each agent keeps (runtime/trace.py): every stage of the timed rooms, whatever the run's size.
TRACE_MARKS = 1 << 16
#: The agents' liveness, as in the throughput bench: generous, since a starved 2-core host stalls threads.
TIMING = Timing(heartbeat_s=0.5, dead_after_s=60.0, retry_initial_s=0.05, retry_max_s=1.0)
#: How often decode's main thread polls while a timed room lands (the clock's resolution); prefill's (its outcomes
#: only gate the next room); and decode ranks other than the engine's while rooms stream.
SPIN_S, PREFILL_POLL_S, STREAM_POLL_S = 50e-6, 0.01, 0.001
#: Between announcing a room (attach, compute scheduled) and its first chunk's `kv_ready`: the grants come in.
SETTLE_S = 0.1
#: Rooms the engine keeps expected ahead of the last one landed while rooms stream.
EXPECT_AHEAD = 4
ROOM_TIMEOUT_S = 60.0
#: Default gap between chunk releases, long enough that a chunk of the default size has landed before the next.
DEFAULT_GAP_MS, DEFAULT_ROOMS = {"cpu": 20.0, "cuda": 5.0}, 10
#: The engine's step: CPU, CPU_MATMULS x (CPU_N^2 fp32 matmul + tanh), about 2 ms on one core; GPU, GPU_MATMULS x
#: (GPU_N^2 bf16 matmul + tanh) then a stream sync, sized for about 1.5 ms on an H100. Plus PY_ITEMS of Python.
CPU_N, CPU_MATMULS, GPU_N, GPU_MATMULS, PY_ITEMS = 256, 8, 4096, 8, 1024
ENGINE_STEP = {
    "cpu": f"{CPU_MATMULS} x ({CPU_N}^2 fp32 matmul + tanh) on the torch CPU threads, {PY_ITEMS} items of Python",
    "cuda": f"{GPU_MATMULS} x ({GPU_N}^2 bf16 matmul + tanh), stream sync, {PY_ITEMS} items of Python",
}


class HandoffError(KVStageError):
    """The scenario could not measure: a rank or a room failed, a deadline passed, or bytes differ."""


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    """One handoff run: `bench` gives the model, TP pair, sizes and backend; `bench.repeats` is the timed rooms per
    latency scenario. `gap_s` between chunk releases; phase B streams chunks at `chunk_rate_hz` for `stream_s`."""

    bench: BenchConfig
    gap_s: float
    chunk_rate_hz: float = 500.0
    stream_s: float = 2.0

    def __post_init__(self) -> None:
        b = self.bench
        if b.concurrency != 1:
            raise ConfigError("--handoff moves one request at a time: --concurrency must be 1")
        if b.chunks_per_request < TAIL_CHUNKS:
            raise ConfigError(
                f"--handoff needs at least {TAIL_CHUNKS} chunks per request: --tokens {b.tokens} is "
                f"{b.chunks_per_request} chunk(s) of --chunk-tokens {b.chunk_tokens}"
            )
        for flag, value in (("--gap-ms", self.gap_s), ("--chunk-rate-hz", self.chunk_rate_hz),
                            ("--stream-s", self.stream_s)):  # fmt: skip
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a positive number, got {value!r}")

    @property
    def stream_rooms(self) -> int:
        return stream_rooms(self.stream_s, self.chunk_rate_hz, self.bench.chunks_per_request)


# ---- a rank process --------------------------------------------------------------------------------------------


def pool_device(config: BenchConfig, role: str, rank: int) -> str:
    """ "cpu", or a GPU: prefill ranks first, then decode ranks, round robin over the host's GPUs."""
    if config.device == "cpu":
        return "cpu"
    slot = rank if role == PREFILL else config.prefill_tp + rank
    return f"cuda:{slot % torch.cuda.device_count()}"


def torch_threads(config: BenchConfig) -> int:
    """Host pools: the rank's share of the host's cores (its copies run on them); GPU pools: one."""
    if config.device != "cpu":
        return 1
    return max(1, len(os.sched_getaffinity(0)) // (config.prefill_tp + config.decode_tp))


def byte_view(pool: KVPool) -> torch.Tensor:
    """`[2, L, slots, heads, head_bytes]` uint8 view of a pool."""
    g = pool.geometry
    return pool.flat.view(2, pool.layout.num_layers, g.num_slots, pool.num_heads, pool.layout.head_bytes)


def head_kv(config: BenchConfig, head: int) -> torch.Tensor:
    """Seeded bytes of one global head of the request: uint8 `[2, L, tokens, head_bytes]`."""
    layout = config.layout
    gen = torch.Generator().manual_seed(config.seed * 7919 + head)
    return torch.randint(0, 256, (2, layout.num_layers, config.tokens, layout.head_bytes), dtype=torch.uint8,
                         generator=gen)  # fmt: skip


def head_digests(config: BenchConfig, pool: KVPool, heads: range, pages: tuple[int, ...]) -> dict[int, str]:
    """SHA-256 of tokens [0, tokens) of each held global head, as stored in `pool`."""
    landed = byte_view(pool).index_select(2, pool.slot_indices(pages, 0, config.tokens)).cpu()
    return {head: hashlib.sha256(landed[:, :, :, i].contiguous().numpy().tobytes()).hexdigest()
            for i, head in enumerate(heads)}  # fmt: skip


def wait_until(at: float) -> None:
    time.sleep(max(0.0, at - time.monotonic()))


def engine_step(device: str) -> Callable[[], None]:
    """The stand-in engine's fixed step on `device` (see CPU_N, GPU_N)."""
    gen = torch.Generator().manual_seed(1)
    n, count = (CPU_N, CPU_MATMULS) if device == "cpu" else (GPU_N, GPU_MATMULS)
    a, b = (torch.randn(n, n, generator=gen).to(device, torch.float32 if device == "cpu" else torch.bfloat16)
            for _ in range(2))  # fmt: skip
    stream = None if device == "cpu" else torch.cuda.current_stream(torch.device(device))

    def step() -> None:
        x = a
        for _ in range(count):
            x = torch.tanh(x @ b)
        if stream is not None:
            stream.synchronize()
        table = {i: (i * 7) % 97 for i in range(PY_ITEMS)}  # the scheduler's Python work
        sorted(table.items(), key=lambda kv: kv[1])

    return step


class _Rank:
    """One rank: its KV pool (every page held by the engine; the request's pages a seeded permutation), its agent."""

    role: str
    agent: DecodeAgent | PrefillAgent

    def __init__(self, config: HandoffConfig, rank: int, bootstrap: str) -> None:
        b = config.bench
        self.config, self.bench, self.rank, self.bootstrap = config, b, rank, bootstrap
        self.tp = b.prefill_tp if self.role == PREFILL else b.decode_tp
        self.heads = heads_of_rank(b.layout.num_kv_heads, self.tp, rank)
        self.pool = KVPool.for_rank(b.layout, self.tp, rank, b.pool_pages, pool_device(b, self.role, rank))
        self.pool.allocator.allocate(b.pool_pages, owner="engine")
        gen = torch.Generator().manual_seed(b.seed * 31 + (0 if self.role == PREFILL else 1009) + rank)
        self.pages = tuple(torch.randperm(b.pool_pages, generator=gen).tolist())

    def agent_config(self) -> AgentConfig:
        return AgentConfig(
            instance=self.role, rank=self.rank, tp_size=self.tp, layout=self.bench.layout, bootstrap=self.bootstrap,
            transport=TransportConfig(backend=self.bench.backend), timing=TIMING,
            chunk_tokens=self.bench.chunk_tokens, writes_per_peer=self.bench.writes_per_peer, trace_chunks=TRACE_MARKS,
        )  # fmt: skip

    def cpu(self) -> tuple[float, float]:
        """(this process's CPU seconds, this main thread's), read on the main thread."""
        return time.process_time(), time.thread_time()

    def finished(self, rooms: set[int] | range) -> list[int]:
        """Rooms of `rooms` that ended since the last poll; a failed one raises with its reason."""
        done = []
        for outcome in self.agent.poll():
            if not outcome.ok:
                raise HandoffError(f"{self.role}{self.rank}: room {outcome.room} failed: {outcome.reason}")
            if outcome.room in rooms:
                done.append(outcome.room)
        return done

    def wait_rooms(self, rooms: set[int], poll_s: float, deadline: float) -> float:
        """Poll every `poll_s` until every room ended; when the last one was seen."""
        pending = set(rooms)
        while True:
            pending.difference_update(self.finished(pending))
            seen = time.monotonic()
            if not pending:
                return seen
            if seen > deadline:
                raise HandoffError(f"{self.role}{self.rank}: rooms {sorted(pending)} still open at their deadline")
            time.sleep(poll_s)

    def info(self) -> dict[str, Any]:
        return {"kvstage": os.path.abspath(kvstage.__file__)}

    def marks(self) -> list[Mark]:  # the agent's chunk marks (and the bench's own) since the last call
        return [(m.room, m.chunk, m.stage, m.at) for m in self.agent.trace.drain()]

    def close(self) -> None:
        self.agent.close()


class DecodeRank(_Rank):
    """A decode rank: expects rooms and sees their outcomes; rank 0 also plays the engine in the interference test."""

    role = DECODE

    def __init__(self, config: HandoffConfig, rank: int, bootstrap: str) -> None:
        super().__init__(config, rank, bootstrap)
        ring = replace(self.agent_config(), ring_bytes=self.bench.ring_bytes(rank))
        self.decode_agent = DecodeAgent(ring, self.pool)
        self.decode_agent.start()
        self.agent = self.decode_agent
        self.peers = tuple(peer_id(PREFILL, r) for r in range(self.bench.prefill_tp))
        self.step = engine_step(str(self.pool.device)) if rank == 0 else None

    def expect(self, room: int) -> None:
        self.decode_agent.expect_room(room, self.peers, self.bench.tokens, 0, self.pages, ROOM_TIMEOUT_S)

    def wait(self, room: int, deadline: float) -> float:
        """Spin (every SPIN_S) until `room` lands; the moment this thread saw it."""
        seen = self.wait_rooms({room}, SPIN_S, deadline)
        self.agent.trace.mark(room, self.bench.chunks_per_request - 1, "seen")
        return seen

    def zero(self) -> None:
        byte_view(self.pool).index_fill_(2, self.pool.slot_indices(self.pages, 0, self.bench.tokens), 0)

    def digests(self) -> dict[int, str]:
        return head_digests(self.bench, self.pool, self.heads, self.pages)

    def engine(self, rooms: list[int], count_from: float, until: float, deadline: float) -> tuple[list[float], float]:
        """Run the engine loop until `until` (or, with rooms, until every room landed): each step polls the agent,
        keeps EXPECT_AHEAD rooms expected, and runs the fixed step (decode rank 0; others sleep STREAM_POLL_S).
        Returns the durations of the steps begun from `count_from`, and when the last room was seen to land."""
        steps: list[float] = []
        expected = landed = 0
        last = time.monotonic()
        pending = set(rooms)
        while (began := time.monotonic()) < until or (rooms and landed < len(rooms)):
            if began > deadline:
                raise HandoffError(f"decode rank {self.rank}: {len(rooms) - landed} streamed room(s) open at deadline")
            done = self.finished(pending)
            if done:
                pending.difference_update(done)
                landed, last = landed + len(done), began
            while expected < len(rooms) and expected - landed < EXPECT_AHEAD:
                self.expect(rooms[expected])
                expected += 1
            if self.step is None:
                time.sleep(STREAM_POLL_S)
                continue
            self.step()
            if began >= count_from:
                steps.append(time.monotonic() - began)
        return steps, last


class PrefillRank(_Rank):
    """A prefill rank: fills its pool with seeded KV per global head, then announces rooms and releases chunks."""

    role = PREFILL

    def __init__(self, config: HandoffConfig, rank: int, bootstrap: str) -> None:
        super().__init__(config, rank, bootstrap)
        slots = self.pool.slot_indices(self.pages, 0, self.bench.tokens)
        for i, head in enumerate(self.heads):
            byte_view(self.pool)[:, :, :, i].index_copy_(2, slots, head_kv(self.bench, head).to(self.pool.device))
        self.head_digests = head_digests(self.bench, self.pool, self.heads, self.pages)
        staging = replace(self.agent_config(), staging_bytes=self.bench.staging_bytes(rank))
        self.prefill_agent = PrefillAgent(staging, self.pool)
        self.prefill_agent.start()
        self.agent = self.prefill_agent

    def info(self) -> dict[str, Any]:
        return {**super().info(), "digests": self.head_digests}

    def announce(self, room: int) -> None:
        """The forward pass that computes `room` starts: attach it and schedule all of its tokens."""
        self.prefill_agent.attach_room(room, self.bench.tokens, self.bench.decode_tp, ROOM_TIMEOUT_S)
        self.prefill_agent.compute_scheduled(room, self.bench.tokens)

    def release(self, room: int, schedule: list[tuple[float, int]], deadline: float) -> float:
        """`kv_ready(room, end)` at each (time, end) of `schedule`; waits for the room's outcome and for the agent
        to go quiet. Returns when the last `kv_ready` was called."""
        last = 0.0
        for at, end in schedule:
            wait_until(at)
            last = time.monotonic()
            self.prefill_agent.kv_ready(room, end, self.pages)
            self.agent.trace.mark(room, (end - 1) // self.bench.chunk_tokens, "kv_ready")
        self.wait_rooms({room}, PREFILL_POLL_S, deadline)
        self.quiesce(deadline)
        return last

    def stream(self, rooms: list[int], ends: list[int], start_at: float, deadline: float) -> None:
        """Rooms back to back from `start_at`: chunk j (counted over all rooms) ready at start_at + j / rate; each
        room announced as the previous one's first chunk is released."""
        period = 1 / self.config.chunk_rate_hz
        self.announce(rooms[0])
        for i, room in enumerate(rooms):
            for k, end in enumerate(ends):
                wait_until(start_at + (i * len(ends) + k) * period)
                self.prefill_agent.kv_ready(room, end, self.pages)
                if k == 0 and i + 1 < len(rooms):
                    self.announce(rooms[i + 1])
        self.wait_rooms(set(rooms), PREFILL_POLL_S, deadline)
        self.quiesce(deadline)

    def quiesce(self, deadline: float) -> None:
        if not self.agent.wait_quiescent(max(0.0, deadline - time.monotonic())):
            raise HandoffError(f"prefill rank {self.rank}: the agent is still busy at the deadline")


COMMANDS = {
    DECODE: frozenset({"cpu", "expect", "wait", "zero", "digests", "engine", "marks"}),
    PREFILL: frozenset({"cpu", "announce", "release", "stream", "marks"}),
}


def rank_main(conn: Connection, role: str, rank: int, config: HandoffConfig, bootstrap: str) -> None:
    """Process body: build the rank, report `("ok", info)`, then answer (command, *args) until "stop"."""
    torch.set_num_threads(torch_threads(config.bench))
    try:
        node = DecodeRank(config, rank, bootstrap) if role == DECODE else PrefillRank(config, rank, bootstrap)
        conn.send(("ok", node.info()))
        try:
            while (message := conn.recv())[0] != "stop":
                command, *args = message
                if command not in COMMANDS[role]:
                    raise HandoffError(f"{role}{rank}: unknown command {command!r}")
                conn.send(("ok", getattr(node, command)(*args)))
        finally:
            node.close()
        conn.send(("ok", None))
    except BaseException as exc:  # reported to the parent, then re-raised so the process exits non-zero
        conn.send(("error", f"{role}{rank}: {type(exc).__name__}: {exc}"))
        raise


# ---- the parent ------------------------------------------------------------------------------------------------


class _Proc:
    """One rank process and the parent's end of its pipe; `recv` makes silence, death and errors `HandoffError`."""

    def __init__(self, role: str, rank: int, config: HandoffConfig, bootstrap: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = f"{'prefill' if role == PREFILL else 'decode'} rank {rank}"
        self.process: BaseProcess = ctx.Process(target=rank_main, args=(child, role, rank, config, bootstrap),
                                                name=f"kvstage-handoff-{role}{rank}", daemon=True)  # fmt: skip
        self.process.start()
        child.close()

    def send(self, command: str, *args: Any) -> None:
        self.conn.send((command, *args))

    def recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(max(0.0, timeout_s)):
            raise HandoffError(f"{self.name} did not answer within {timeout_s:.0f} s")
        try:
            status, payload = self.conn.recv()
        except EOFError as err:
            self.process.join(5)
            raise HandoffError(f"{self.name} exited (code {self.process.exitcode}) without answering") from err
        if status != "ok":
            raise HandoffError(str(payload))
        return payload

    def stop(self, graceful: bool) -> None:
        """Ask the rank to close and exit (`graceful`), or kill it: after a failure its peers may never answer."""
        if graceful and self.process.is_alive():
            try:
                self.send("stop")
                self.recv(30)
            except (HandoffError, OSError):
                self.process.kill()
        self.process.join(30 if graceful else 0.1)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


#: Seconds a command may take beyond its own schedule before the parent gives up on the rank.
REPLY_S = ROOM_TIMEOUT_S + 60


class _Cluster:
    """The rank processes around one bootstrap service, and the scenario's steps over them."""

    def __init__(self, config: HandoffConfig, bootstrap: str) -> None:
        self.config, self.bench, self.bootstrap = config, config.bench, bootstrap
        self.decode: list[_Proc] = []
        self.prefill: list[_Proc] = []
        self.prefill_digests: dict[int, str] = {}
        self.next_room = 1

    def start(self) -> None:
        self.decode = [_Proc(DECODE, r, self.config, self.bootstrap) for r in range(self.bench.decode_tp)]
        infos = [rank.recv(REPLY_S) for rank in self.decode]
        self.prefill = [_Proc(PREFILL, r, self.config, self.bootstrap) for r in range(self.bench.prefill_tp)]
        infos += [rank.recv(REPLY_S) for rank in self.prefill]
        for info in infos[self.bench.decode_tp :]:
            self.prefill_digests.update(info["digests"])
        ours = os.path.abspath(kvstage.__file__)
        if any(info["kvstage"] != ours for info in infos):
            raise HandoffError(f"a rank process imported another kvstage than the parent's ({ours})")

    def stop(self, graceful: bool) -> None:
        for rank in self.prefill + self.decode:
            rank.stop(graceful)

    @property
    def ranks(self) -> list[_Proc]:
        return self.prefill + self.decode

    def rooms(self, count: int) -> list[int]:
        first, self.next_room = self.next_room, self.next_room + count
        return list(range(first, first + count))

    @staticmethod
    def each(ranks: list[_Proc], command: str, *args: Any, timeout_s: float = REPLY_S) -> list[Any]:
        for rank in ranks:
            rank.send(command, *args)
        return [rank.recv(timeout_s) for rank in ranks]

    def handoff(self, ends: list[int]) -> float:
        """One room, chunks released at `ends`, `gap_s` apart: seconds from the last `kv_ready` (the latest over
        prefill ranks) to decode's main thread seeing the outcome (the latest over decode ranks)."""
        (room,) = self.rooms(1)
        self.each(self.decode, "expect", room)
        self.each(self.prefill, "announce", room)
        start = time.monotonic() + SETTLE_S
        schedule = [(start + k * self.config.gap_s, end) for k, end in enumerate(ends)]
        deadline = schedule[-1][0] + ROOM_TIMEOUT_S
        for rank in self.decode:
            rank.send("wait", room, deadline)
        wait_s = deadline - time.monotonic() + REPLY_S
        released = self.each(self.prefill, "release", room, schedule, deadline, timeout_s=wait_s)
        seen = [rank.recv(REPLY_S) for rank in self.decode]
        return float(max(seen) - max(released))

    def cpu(self) -> list[tuple[float, float]]:
        return self.each(self.ranks, "cpu")

    def verify(self) -> str:
        """Decode's KV equals prefill's, head by head (after a room landed into zeroed pages)."""
        for d, digests in enumerate(self.each(self.decode, "digests")):
            for head, digest in digests.items():
                if digest != self.prefill_digests[head]:
                    raise HandoffError(f"decode rank {d}: head {head} differs from prefill's")
        heads = self.bench.layout.num_kv_heads
        return f"{heads} heads of the warm-up room bit-exact on every decode rank (SHA-256, prefill vs decode)"

    def interference(self) -> tuple[list[float], list[float], float]:
        """Phase A (engine alone for `stream_s`), then phase B (rooms streamed): step durations of each, and the
        seconds from phase B's first chunk to its last room landing on decode rank 0."""
        engine, rest = self.decode[0], self.decode[1:]
        begin = time.monotonic()
        engine.send("engine", [], begin, begin + self.config.stream_s, begin + REPLY_S)
        idle, _ = engine.recv(self.config.stream_s + REPLY_S)
        rooms = self.rooms(self.config.stream_rooms)
        ends = chunk_ends(self.bench.tokens, self.bench.chunk_tokens)
        start = time.monotonic() + SETTLE_S
        chunks = len(rooms) * len(ends)
        deadline = start + chunks / self.config.chunk_rate_hz + ROOM_TIMEOUT_S
        for rank in self.decode:
            rank.send("engine", rooms, start, start, deadline)
        self.each(self.prefill, "stream", rooms, ends, start, deadline, timeout_s=deadline - time.monotonic() + REPLY_S)
        busy, landed = engine.recv(REPLY_S)
        for rank in rest:
            rank.recv(REPLY_S)
        return idle, busy, landed - start


@dataclass(frozen=True, slots=True)
class HandoffResult:
    """One run's samples: per-room latencies (s), per-rank CPU (s) over the timed isolated rooms, engine steps (s)."""

    config: HandoffConfig
    isolated_s: tuple[float, ...]
    tail_s: tuple[float, ...]
    cpu_s: dict[str, float]
    idle_steps_s: tuple[float, ...]
    busy_steps_s: tuple[float, ...]
    stream_span_s: float  #: phase B: from its first chunk's release to its last room landing on decode rank 0
    checks: tuple[str, ...]
    isolated_stages_ms: dict[str, float]  #: the isolated rooms' last chunk, by stage (`stage_offsets_ms`)

    def summary(self) -> dict[str, Any]:
        """The `--json` object."""
        c, b = self.config, self.config.bench
        chunks = len(self.isolated_s) * b.chunks_per_request
        streamed = c.stream_rooms * b.chunks_per_request
        return {
            "scenario": "handoff",
            "handoff_isolated_ms": latency_ms(self.isolated_s),
            "handoff_tail4_ms": latency_ms(self.tail_s),
            "handoff_isolated_stages_ms": self.isolated_stages_ms,
            "cpu_per_chunk_ms": cpu_per_chunk_ms(self.cpu_s, chunks),
            "interference": interference(self.idle_steps_s, self.busy_steps_s) | {
                "chunk_rate_hz": c.chunk_rate_hz, "stream_rooms": c.stream_rooms, "stream_chunks": streamed,
                "stream_span_s": self.stream_span_s, "landed_rate_hz": streamed / self.stream_span_s,
                "engine_step": ENGINE_STEP[b.device],
            },
            "backend": b.backend, "model": b.model, "prefill_tp": b.prefill_tp, "decode_tp": b.decode_tp,
            "page_size": b.page_size, "tokens": b.tokens, "chunk_tokens": b.chunk_tokens,
            "chunks": b.chunks_per_request, "rooms": b.repeats, "device": b.device, "ring_chunks": b.ring_chunks,
            "writes_per_peer": b.writes_per_peer, "gap_ms": c.gap_s * 1e3, "stream_s": c.stream_s,
            "verified": list(self.checks),
        }  # fmt: skip


def total_steps(config: HandoffConfig) -> int:
    """How many times `run_handoff` calls `step`: start-up, warm-up, each timed room twice, interference."""
    return 3 + 2 * config.bench.repeats


def run_handoff(config: HandoffConfig, step: Callable[[str], None] | None = None) -> HandoffResult:
    """Run the scenario described by `config`; `step(description)` is called as each stage begins."""
    announce = step or (lambda _: None)
    b = config.bench
    if b.device == "cuda" and not torch.cuda.is_available():
        raise HandoffError("--device cuda needs a CUDA GPU, and torch sees none on this machine")
    ends = chunk_ends(b.tokens, b.chunk_tokens)
    server = BootstrapServer().start()
    cluster = _Cluster(config, server.address)
    finished = False
    try:
        announce(f"starting {b.prefill_tp} prefill + {b.decode_tp} decode rank processes")
        cluster.start()
        announce("warm-up room (verified)")
        cluster.each(cluster.decode, "zero")
        cluster.handoff(ends)
        checks = [cluster.verify()]
        cluster.each(cluster.ranks, "marks")  # the warm-up room's are dropped
        before = cluster.cpu()
        isolated = []
        for i in range(b.repeats):
            announce(f"isolated handoff: room {i + 1}/{b.repeats}")
            isolated.append(cluster.handoff(ends))
        after = cluster.cpu()
        stages = stage_offsets_ms([m for ms in cluster.each(cluster.ranks, "marks") for m in ms], len(ends))
        tail = []
        for i in range(b.repeats):
            announce(f"tail with {TAIL_CHUNKS} ready: room {i + 1}/{b.repeats}")
            tail.append(cluster.handoff(tail_ends(b.tokens, b.chunk_tokens)))
        announce(f"engine interference: {config.stream_s:g} s idle, then {config.stream_rooms} rooms streamed")
        idle, busy, span = cluster.interference()
        rooms = 1 + 2 * b.repeats + config.stream_rooms
        checks.append(f"{rooms} rooms, every one successful on every rank")
        finished = True
    finally:
        cluster.stop(graceful=finished)
        server.close()
    names = [f"prefill {r}" for r in range(b.prefill_tp)] + [f"decode {r}" for r in range(b.decode_tp)]
    cpu = {name: (a[0] - z[0]) - (a[1] - z[1]) for name, z, a in zip(names, before, after, strict=True)}
    return HandoffResult(config, tuple(isolated), tuple(tail), cpu, tuple(idle), tuple(busy), span, tuple(checks),
                         stages)  # fmt: skip
