"""Runs one `kvstage bench`: spawns every rank, warms up and verifies, then times three paths side by side.

Owns the run's sequence and the arithmetic of its results:

1. a bootstrap service in this process; one process per decode rank, then one per prefill rank
   (`kvstage.bench.worker`), all on the chosen backend;
2. an untimed warm-up of the raw bulk path (which also opens the per-slice path's connections; every bulk write
   must land bit-exact) and of the staged path (agents' connections, handshakes, first-touch page faults);
3. `repeats` timed rounds, each running staged, per-slice and raw one after the other (interleaved, so that
   drift in the machine's load hits all three alike; `slice_rounds` leaves the slow per-slice path out of the later
   rounds). Between the first round's per-slice and raw runs, the bytes
   are verified: decode's digest of every head the staged path landed equals prefill's digest of that head, and
   the per-slice path landed byte-for-byte what the staged path landed, in every used slot of every request.

Each round starts every rank at one shared `time.monotonic()` instant; a path's time is the non-overlapping wall
time from the first rank's start to the last completion (staged: the last decode rank's last room outcome,
i.e. scattered into its KV pool). GB/s is bytes moved / that time, in 1e9 bytes per second. Operations are the
transfer operations the ranks' transports issued (`DataTransport.ops_issued`), per request. Each staged round
also breaks a chunk's time into the segments of its path, from the agents' chunk stamps (bench/stages.py).

Invariants: every wait has a deadline; any failed room, transfer or mismatch is a `BenchError` with its reason
(never a number); every process started is stopped (or killed) on the way out. Called by the CLI and tests.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from kvstage.bench.config import BenchConfig
from kvstage.bench.stages import chunk_breakdown
from kvstage.bench.worker import DECODE, PREFILL, Timed, worker_main
from kvstage.errors import KVStageError
from kvstage.transport.bootstrap import BootstrapServer

#: Seconds between sending a round's command and its shared start instant. On the staged path this is the
#: engine's forward pass: rooms are announced (attach, compute_scheduled) at once and KV is ready at the start.
START_DELAY_S = 0.2
PATHS = ("staged", "slice", "raw")
#: One timed round: wall seconds, transfer ops, the busiest rank's seconds per stage, a chunk's segments.
Round = tuple[float, int, dict[str, float], dict[str, float]]


class BenchError(KVStageError):
    """The bench could not measure: a rank failed, a room failed, a transfer failed, or bytes differ."""


@dataclass(frozen=True, slots=True)
class PathResult:
    """Timed rounds of one path: wall seconds of each round, bytes each round moved, operations per request."""

    name: str
    seconds: tuple[float, ...]
    nbytes: int
    ops_per_request: float
    #: per round, the busiest rank's seconds in each stage (staged path only)
    stages: tuple[dict[str, float], ...] = ()
    #: per round, a chunk's median seconds in each segment of its path (staged path only; bench/stages.py)
    chunks: tuple[dict[str, float], ...] = ()

    @property
    def best_round(self) -> int:
        return self.seconds.index(min(self.seconds))

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9


@dataclass(frozen=True, slots=True)
class BenchResult:
    """One run's three paths and what was verified. Headline GB/s is the best round of each path."""

    config: BenchConfig
    staged: PathResult
    slice: PathResult
    raw: PathResult
    slice_descriptors_per_request: int
    checks: tuple[str, ...]
    #: GPUs the ranks' KV pools are spread over (0 for host pools); with one, every rank shares it
    gpus: int = 0

    def staged_stages(self) -> dict[str, float]:
        """Wall seconds of the best staged round and, for each stage, the busiest rank's seconds in it."""
        best = self.staged.best_round
        return {"wall": self.staged.seconds[best], **self.staged.stages[best]}

    def chunk_segments(self) -> dict[str, float]:
        """Per segment of a chunk's path, the median over rounds of each round's median seconds (bench/stages.py)."""
        rounds = self.staged.chunks
        names = {name for r in rounds for name in r}
        return {name: statistics.median(r[name] for r in rounds if name in r) for name in sorted(names)}

    @property
    def paths(self) -> tuple[PathResult, PathResult, PathResult]:
        return (self.staged, self.slice, self.raw)

    @property
    def staged_over_raw_paired(self) -> float:
        """Median over rounds of staged/raw within the round (both move the same bytes, one right after the
        other), which drift in the machine's load between rounds does not move as much as best over best."""
        return statistics.median(r / s for s, r in zip(self.staged.seconds, self.raw.seconds, strict=True))

    def summary(self) -> dict[str, Any]:
        """The `--json` object."""
        c = self.config
        return {
            "agents_path": "direct" if c.prefill_tp == c.decode_tp else "staged",  # the "staged" keys' path
            "staged_gbps": self.staged.best_gbps,
            "slice_gbps": self.slice.best_gbps,
            "raw_gbps": self.raw.best_gbps,
            "staged_over_raw": self.staged.best_gbps / self.raw.best_gbps,
            "staged_over_slice": self.staged.best_gbps / self.slice.best_gbps,
            "staged_over_raw_paired": self.staged_over_raw_paired,
            "ops_staged": self.staged.ops_per_request,
            "ops_slice": self.slice.ops_per_request,
            "ops_raw": self.raw.ops_per_request,
            "slice_ops_over_staged": self.slice.ops_per_request / self.staged.ops_per_request,
            "slice_descriptors": self.slice_descriptors_per_request,
            "median_gbps": {p.name: p.median_gbps for p in self.paths},
            "seconds": {p.name: list(p.seconds) for p in self.paths},
            "bytes_per_request": c.moved_bytes,
            "backend": c.backend,
            "model": c.model,
            "prefill_tp": c.prefill_tp,
            "decode_tp": c.decode_tp,
            "page_size": c.page_size,
            "tokens": c.tokens,
            "chunk_tokens": c.chunk_tokens,
            "concurrency": c.concurrency,
            "repeats": c.repeats,
            "device": c.device,
            "ring_chunks": c.ring_chunks,
            "writes_per_peer": c.writes_per_peer,
            "verified": list(self.checks),
            "gpus": self.gpus,
            "staged_stages_s": self.staged_stages(),
            "chunk_segments_s": self.chunk_segments(),
        }


Step = Callable[[str], None]


class RankProcess:
    """One rank's worker process and the parent's end of its pipe. The worker answers each command with
    ("ok" or "ready", payload) or ("error", message); `recv` turns silence, death and errors into `BenchError`.
    Also used by benchmarks/host_ceiling.py."""

    def __init__(self, process: BaseProcess, conn: Connection, name: str, timeout_s: float) -> None:
        self.process, self.conn, self.name, self.timeout_s = process, conn, name, timeout_s

    @classmethod
    def spawn(cls, target: Callable[..., None], args: tuple[Any, ...], name: str, timeout_s: float) -> RankProcess:
        """Start `target(child_conn, *args)` in a fresh (spawned) daemon process named `name`."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(child, *args), name=f"kvstage-{name.replace(' ', '-')}", daemon=True)
        process.start()
        child.close()
        return cls(process, parent, name, timeout_s)

    def send(self, command: str, *args: Any) -> None:
        self.conn.send((command, *args))

    def recv(self, timeout_s: float | None = None) -> Any:
        wait = self.timeout_s if timeout_s is None else timeout_s
        if not self.conn.poll(wait):
            raise BenchError(f"{self.name} did not answer within {wait:.0f} s")
        try:
            status, payload = self.conn.recv()
        except EOFError as err:
            self.process.join(5)
            raise BenchError(f"{self.name} exited (code {self.process.exitcode}) without answering") from err
        if status != "ok" and status != "ready":
            raise BenchError(str(payload))
        return payload

    def stop(self, graceful: bool) -> None:
        """Ask the rank to close and exit (`graceful`), or kill it: after a failure its peers may never answer."""
        if self.process.is_alive() and graceful:
            try:
                self.send("stop")
                self.recv(30)
            except (BenchError, OSError):
                self.process.kill()
        elif self.process.is_alive():
            self.process.kill()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


class _Cluster:
    """The bench's rank processes around one bootstrap service."""

    def __init__(self, config: BenchConfig, bootstrap: str) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.decode: list[RankProcess] = []
        self.prefill: list[RankProcess] = []
        self.decode_info: list[dict[str, Any]] = []
        self.prefill_info: list[dict[str, Any]] = []

    def start(self) -> None:
        self.decode = [self._spawn(DECODE, r, []) for r in range(self.config.decode_tp)]
        self.decode_info = [rank.recv() for rank in self.decode]
        self.prefill = [self._spawn(PREFILL, r, self.decode_info) for r in range(self.config.prefill_tp)]
        self.prefill_info = [rank.recv() for rank in self.prefill]

    def _spawn(self, role: str, rank: int, decode_info: list[dict[str, Any]]) -> RankProcess:
        name = f"{'prefill' if role == PREFILL else 'decode'} rank {rank}"
        args = (role, rank, self.config, self.bootstrap, decode_info)
        return RankProcess.spawn(worker_main, args, name, self.config.timeout_s)

    def stop(self, graceful: bool) -> None:
        for rank in self.prefill + self.decode:
            rank.stop(graceful)

    # ---- rounds --------------------------------------------------------------------------------------------

    def rooms(self, round_index: int) -> list[tuple[int, int]]:
        c = self.config.concurrency
        return [(1 + round_index * c + slot, slot) for slot in range(c)]

    def staged(self, round_index: int) -> Round:
        """(wall seconds, transfer ops, busiest rank's seconds per stage, chunk segments) of one staged round
        through the agents."""
        rooms = self.rooms(round_index)
        for rank in self.decode:
            rank.send("expect", rooms)
        for rank in self.decode:
            rank.recv()
        for rank in self.decode:
            rank.send("wait", [room for room, _ in rooms])
        start_at = time.monotonic() + START_DELAY_S
        for rank in self.prefill:
            rank.send("staged", rooms, start_at)
        timed: list[Timed] = [rank.recv() for rank in self.prefill]
        ends: list[Timed] = [rank.recv() for rank in self.decode]
        stages: dict[str, float] = {}
        for t in timed + ends:
            for stage, seconds in t.busy:
                stages[stage] = max(stages.get(stage, 0.0), seconds)
        decode_peers = frozenset(mark[0] for t in ends for mark in t.marks)
        segments = chunk_breakdown((mark for t in timed + ends for mark in t.marks), decode_peers)
        return max(t.end for t in ends) - min(t.start for t in timed), sum(t.ops for t in timed), stages, segments

    def baseline(self, command: str) -> Round:
        """(wall seconds, transfer ops, no stages or segments) of one round of the per-slice ("slice") or raw bulk
        ("raw") path."""
        slots = list(range(self.config.concurrency))
        start_at = time.monotonic() + START_DELAY_S
        for rank in self.prefill:
            rank.send(command, slots, start_at)
        timed: list[Timed] = [rank.recv() for rank in self.prefill]
        return max(t.end for t in timed) - min(t.start for t in timed), sum(t.ops for t in timed), {}, {}

    def run(self, path: str, round_index: int) -> Round:
        return self.staged(round_index) if path == "staged" else self.baseline(path)

    # ---- verification --------------------------------------------------------------------------------------

    def verify_staged_and_slice(self) -> list[str]:
        """After one staged and one per-slice round: both landed the bytes prefill holds, in the same places."""
        for rank in self.decode:
            rank.send("verify")
        reports = [rank.recv() for rank in self.decode]
        expected = self._prefill_head_digests()
        for d, report in enumerate(reports):
            if not report["staged_equals_slice"]:
                raise BenchError(f"decode rank {d}: the per-slice path landed different bytes than the staged path")
            for slot, digests in enumerate(report["heads"]):
                for head, digest in digests.items():
                    if digest != expected[slot][head]:
                        raise BenchError(f"decode rank {d}, request {slot}: head {head} differs from prefill's")
        heads = self.config.layout.num_kv_heads
        return [
            f"staged: {heads} heads x {self.config.concurrency} request(s) bit-exact (SHA-256, prefill vs decode)",
            "per-slice: every used KV slot on every decode rank equal to what the staged path landed",
        ]

    def _prefill_head_digests(self) -> list[dict[int, str]]:
        merged: list[dict[int, str]] = [{} for _ in range(self.config.concurrency)]
        for info in self.prefill_info:
            for slot, digests in enumerate(info["digests"]):
                merged[slot].update(digests)
        return merged

    def verify_raw(self) -> list[str]:
        """After one raw round: every bulk write landed bit-exact."""
        wanted: dict[int, list[tuple[int, int, str]]] = {d: [] for d in range(self.config.decode_tp)}
        for info in self.prefill_info:
            for per_slot in info["raw"]:
                for decode_rank, offset, nbytes, digest in per_slot:
                    wanted[decode_rank].append((offset, nbytes, digest))
        for d, rank in enumerate(self.decode):
            rank.send("digest", [(offset, n) for offset, n, _ in wanted[d]])
        for d, rank in enumerate(self.decode):
            got = rank.recv()
            if got != [digest for _, _, digest in wanted[d]]:
                raise BenchError(f"decode rank {d}: a raw bulk write did not land bit-exact")
        return [f"raw: {sum(len(w) for w in wanted.values())} bulk write(s) bit-exact"]

    def slice_descriptors(self) -> int:
        """Per-slice descriptors (layer x K/V x page x head run) of request slot 0, over every prefill rank."""
        return sum(info["slice_descriptors"][0] for info in self.prefill_info)


def total_steps(config: BenchConfig) -> int:
    """How many times `run_bench` calls `step`: start-up, two warm-up stages, then one per path per round."""
    rounds = range(1, config.repeats + 1)
    return 3 + sum(1 for r in rounds for p in PATHS if p != "slice" or config.times_slice(r))


def run_bench(config: BenchConfig, step: Step | None = None) -> BenchResult:
    """Run the bench described by `config`; `step(description)` is called as each stage begins."""
    announce = step or (lambda _: None)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda needs a CUDA GPU, and torch sees none on this machine")
    server = BootstrapServer().start()
    cluster = _Cluster(config, server.address)
    finished = False
    try:
        announce(f"starting {config.prefill_tp} prefill + {config.decode_tp} decode rank processes")
        cluster.start()
        announce("warm-up: raw bulk")
        cluster.run("raw", 0)
        checks = cluster.verify_raw()
        announce("warm-up: staged")
        cluster.run("staged", 0)
        seconds: dict[str, list[float]] = {p: [] for p in PATHS}
        stages: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
        segments: list[dict[str, float]] = []
        ops: dict[str, int] = {}
        for round_index in range(1, config.repeats + 1):
            for path in PATHS:
                if path == "slice" and not config.times_slice(round_index):
                    continue
                announce(f"round {round_index}/{config.repeats}: {path}")
                wall, ops[path], busy, chunks = cluster.run(path, round_index)
                seconds[path].append(wall)
                if busy:
                    stages[path].append(busy)
                if chunks:
                    segments.append(chunks)
                if round_index == 1 and path == "slice":
                    checks += cluster.verify_staged_and_slice()
        finished = True
    finally:
        cluster.stop(graceful=finished)
        server.close()
    nbytes = config.concurrency * config.moved_bytes
    results = {
        p: PathResult(p, tuple(seconds[p]), nbytes, ops[p] / config.concurrency, tuple(stages[p])) for p in PATHS
    }
    results["staged"] = replace(results["staged"], chunks=tuple(segments))
    gpus = min(config.prefill_tp + config.decode_tp, torch.cuda.device_count()) if config.device == "cuda" else 0
    return BenchResult(
        config, results["staged"], results["slice"], results["raw"], cluster.slice_descriptors(), tuple(checks), gpus
    )
