"""The ceiling a host puts on staged/raw: raw bulk writes alone, and again beside the staged path's copies.

On one host, a transfer between processes goes through host memory, and so do the staged path's copies: gather
(KV pool -> local staging) on every prefill rank and scatter (ring -> KV pool) on every decode rank. Where the
transport is itself a memory copy (NIXL's shared-memory and CMA transports, the `local` backend), both compete
for the same memory system, and no staged implementation can come closer to raw than the writes do while that
copy traffic runs beside them. This script measures that bound for a `kvstage bench` topology, with kvstage's
transports, one process per rank, every round started at one shared instant:

- `raw`: each (prefill rank, decode rank) pair's bytes as `--writes-per-peer` contiguous writes, all in flight
  (`kvstage bench`'s raw path);
- `chunked`: the same bytes as chunk-sized writes, `--writes-per-peer` in flight per pair (the staged path's
  writes);
- `copies`: each prefill rank copies its bytes pool -> staging and each decode rank ring -> pool, chunk by chunk,
  paced evenly over the round's raw time (GPU <-> page-locked host memory with `--device cuda`, a host memcpy with
  `--device cpu`), into and out of host buffers of their own (a gather fills a staging slot that no write reads
  at that moment, a scatter reads a ring region that no write fills). Contiguous copies: the real ones gather
  scattered pages, so this favours the staged path, and the bound stays an upper bound;
- `chunked+copies`: both at once. Reported: the writes' rate (the bound) and the copies' rate beside them.

`chunked+copies / raw` (per round, median) bounds `kvstage bench`'s staged/raw on this host from above, before
pipeline fill and drain and control messages. Example (see docs/benchmarks.md):

    python benchmarks/host_ceiling.py --backend nixl --device cuda --model llama3-8b --prefill-tp 4 --decode-tp 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvstage.bench.config import DEVICES, BenchConfig
from kvstage.bench.runner import BenchError, RankProcess
from kvstage.bench.worker import DECODE, PREFILL, pool_device, split_evenly, wait_until
from kvstage.errors import ConfigError
from kvstage.layout import plan_staging
from kvstage.transport.data import BACKENDS, TransportConfig, create_transport, decode_descriptor, encode_descriptor

MODES = ("raw", "chunked", "copies", "chunked+copies")
#: Seconds between the parent's "go" and the round's shared start instant.
START_DELAY_S = 0.3
ROUND_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Pair:
    """What one prefill rank sends one decode rank per request: `nbytes` at `src` in its region, `dst` in the
    decode rank's; `chunk_bytes` per chunk."""

    prefill: int
    decode: int
    src: int
    dst: int
    nbytes: int
    chunk_bytes: int


def plan_pairs(config: BenchConfig) -> list[Pair]:
    """Every (prefill rank, decode rank) pair of the topology, with source offsets packed per prefill rank."""
    pairs, used = [], [0] * config.prefill_tp
    for decode in range(config.decode_tp):
        whole = plan_staging(config.layout, config.prefill_tp, config.decode_tp, decode, config.tokens)
        chunk = plan_staging(config.layout, config.prefill_tp, config.decode_tp, decode, config.chunk_tokens)
        for block in whole.blocks:
            p = block.prefill_rank
            pairs.append(Pair(p, decode, used[p], block.offset, block.nbytes, chunk.block_of(p).nbytes))
            used[p] += block.nbytes
    return pairs


def region_bytes(config: BenchConfig, role: str, rank: int, pairs: list[Pair]) -> int:
    """A decode rank receives its heads' bytes; a prefill rank sends its pairs' (at least 64: an idle replica)."""
    if role == DECODE:
        return config.decode_bytes(rank)
    return max(64, sum(p.nbytes for p in pairs if p.prefill == rank))


class Rank:
    """One rank process: its transport region (the bytes it writes or receives) and a stand-in KV pool."""

    def __init__(self, config: BenchConfig, role: str, rank: int, pairs: list[Pair]) -> None:
        self.config, self.role, self.rank = config, role, rank
        self.transport = create_transport(TransportConfig(backend=config.backend))
        self.done = threading.Event()
        self.transport.on_completion(self.done.set)
        nbytes = region_bytes(config, role, rank, pairs)
        device = torch.device(pool_device(config, role, rank))
        self.region = self.transport.allocate(nbytes, pinned=device.type == "cuda")
        self.pool = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.staging = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.pairs = [p for p in pairs if (p.prefill if role == PREFILL else p.decode) == rank]
        self.remotes: dict[int, Any] = {}

    def round(self, mode: str, start_at: float, pace_s: float) -> dict[str, tuple[float, float]]:
        spans: dict[str, tuple[float, float]] = {}
        copier = threading.Thread(target=self._copies, args=(start_at, pace_s, spans))
        if "copies" in mode:
            copier.start()
        if mode != "copies" and self.role == PREFILL and self.pairs:
            start = wait_until(start_at)
            self._write(mode)
            spans["write"] = (start, time.monotonic())
        if copier.is_alive():
            copier.join()
        return spans

    def _write(self, mode: str) -> None:
        """Every pair's writes, at most `writes_per_peer` in flight per pair."""
        window = self.config.writes_per_peer
        queues = {}
        for p in self.pairs:
            parts = window if mode == "raw" else -(-p.nbytes // p.chunk_bytes)
            pieces = split_evenly(p.nbytes, parts)
            queues[p.decode] = deque((p.src + s, p.dst + s, n) for s, n in pieces)
        in_flight: dict[int, int] = {}
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while any(queues.values()) or in_flight:
            for decode, queue in queues.items():
                while queue and sum(1 for d in in_flight.values() if d == decode) < window:
                    src, dst, n = queue.popleft()
                    in_flight[self.transport.write(self.region, src, self.remotes[decode], dst, n)] = decode
            self.done.wait(0.01)
            self.done.clear()
            for completion in self.transport.poll():
                if not completion.ok:
                    raise RuntimeError(f"write failed: {completion.reason}")
                in_flight.pop(completion.transfer_id)
            if time.monotonic() > deadline:
                raise RuntimeError(f"writes still in flight after {ROUND_TIMEOUT_S} s")

    def _copies(self, start_at: float, pace_s: float, spans: dict[str, tuple[float, float]]) -> None:
        """This rank's staged copies, chunk by chunk, the k-th no earlier than `start_at + k * pace_s`."""
        if self.role == DECODE:  # scatter: ring -> pool, one chunk region at a time
            chunk = plan_staging(self.config.layout, self.config.prefill_tp, self.config.decode_tp, self.rank,
                                 self.config.chunk_tokens).total_bytes  # fmt: skip
            src, dst = self.staging, self.pool
        else:  # gather: pool -> staging, one chunk of every block at a time
            chunk = sum(p.chunk_bytes for p in self.pairs) or self.pool.numel()
            src, dst = self.pool, self.staging
        start = wait_until(start_at)
        for k, offset in enumerate(range(0, dst.numel(), chunk)):
            wait_until(start + k * pace_s)
            dst[offset : offset + chunk].copy_(src[offset : offset + chunk])  # returns once landed
        spans["copies"] = (start, time.monotonic())

    def close(self) -> None:
        self.transport.close()


def rank_main(conn: Connection, config: BenchConfig, role: str, rank: int, pairs: list[Pair]) -> None:
    """Process body: report ("ready", descriptor), then answer ("peers", ...), ("round", ...) and ("stop",) with
    ("ok", payload), as `RankProcess` expects; an error is reported as ("error", message), then raised."""
    torch.set_num_threads(1)
    try:
        node = Rank(config, role, rank, pairs)
        conn.send(("ready", encode_descriptor(node.transport.export(node.region))))
        try:
            while (message := conn.recv())[0] != "stop":
                command, *args = message
                if command == "peers":
                    node.remotes = {d: node.transport.import_remote(decode_descriptor(b)) for d, b in args[0].items()}
                    conn.send(("ok", None))
                else:
                    conn.send(("ok", node.round(*args)))
            conn.send(("ok", None))
        finally:
            node.close()
    except BaseException as exc:
        conn.send(("error", f"{role}{rank}: {type(exc).__name__}: {exc}"))
        raise


class Cluster:
    """The rank processes of one topology, connected; `round` runs one mode on all of them at once."""

    def __init__(self, config: BenchConfig, pairs: list[Pair]) -> None:
        self.ranks: dict[tuple[str, int], RankProcess] = {}
        for role, count in ((DECODE, config.decode_tp), (PREFILL, config.prefill_tp)):
            for rank in range(count):
                name = f"{'decode' if role == DECODE else 'prefill'} rank {rank}"
                args = (config, role, rank, pairs)
                self.ranks[(role, rank)] = RankProcess.spawn(rank_main, args, name, ROUND_TIMEOUT_S)
        self.pairs = pairs

    def connect(self) -> None:
        """Wait for every rank's region descriptor and give each prefill rank those of the decode ranks it feeds."""
        descriptors = {key: process.recv() for key, process in self.ranks.items()}
        for (role, rank), process in self.ranks.items():
            feeds = {p.decode for p in self.pairs if p.prefill == rank} if role == PREFILL else set()
            process.send("peers", {d: descriptors[(DECODE, d)] for d in feeds})
            process.recv()

    def round(self, mode: str, pace_s: float) -> list[dict[str, tuple[float, float]]]:
        start_at = time.monotonic() + START_DELAY_S
        for process in self.ranks.values():
            process.send("round", mode, start_at, pace_s)
        return [process.recv() for process in self.ranks.values()]

    def stop(self, graceful: bool) -> None:
        for process in self.ranks.values():
            process.stop(graceful)


def span(spans: list[dict[str, tuple[float, float]]], kind: str) -> float:
    """Wall seconds from the first rank's start to the last rank's end of `kind` ("write" or "copies")."""
    found = [s[kind] for s in spans if kind in s]
    return max(end for _, end in found) - min(start for start, _ in found)


def measure(config: BenchConfig) -> dict[str, Any]:
    """`config.repeats` rounds of every mode, after one warm-up round: GB/s per mode and round, paired ratios."""
    moved = config.moved_bytes
    rows: dict[str, list[float]] = {mode: [] for mode in (*MODES, "copies beside writes")}
    cluster = Cluster(config, plan_pairs(config))
    finished = False
    try:
        cluster.connect()
        for repeat in range(config.repeats + 1):
            raw_s = span(cluster.round("raw", 0.0), "write")
            chunked_s = span(cluster.round("chunked", 0.0), "write")
            pace = raw_s / config.chunks_per_request
            copies_s = span(cluster.round("copies", pace), "copies")
            both = cluster.round("chunked+copies", pace)
            if repeat:
                for mode, nbytes, seconds in (
                    ("raw", moved, raw_s), ("chunked", moved, chunked_s), ("copies", 2 * moved, copies_s),
                    ("chunked+copies", moved, span(both, "write")), ("copies beside writes", 2 * moved,
                    span(both, "copies")),
                ):  # fmt: skip
                    rows[mode].append(nbytes / seconds / 1e9)
                done = "  ".join(f"{m} {rows[m][-1]:.2f}" for m in rows)
                print(f"round {repeat}/{config.repeats} GB/s: {done}", flush=True)
        finished = True
    finally:
        cluster.stop(graceful=finished)  # after a failure a rank may never answer: kill them
    return {
        "backend": config.backend,
        "device": config.device,
        "bytes": moved,
        "gbps": rows,
        "chunked_over_raw": statistics.median(c / r for c, r in zip(rows["chunked"], rows["raw"], strict=True)),
        "ceiling": statistics.median(c / r for c, r in zip(rows["chunked+copies"], rows["raw"], strict=True)),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="local")
    parser.add_argument("--model", default="llama3-8b", help="a kvstage bench preset or an explicit shape")
    parser.add_argument("--prefill-tp", type=int, default=4)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--writes-per-peer", type=int, default=2)
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the stand-in KV pools live")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; this machine has none")
    try:
        config = BenchConfig(
            args.backend, args.model, args.prefill_tp, args.decode_tp, args.page_size, args.tokens, args.chunk_tokens,
            repeats=args.repeats, device=args.device, writes_per_peer=args.writes_per_peer,
        )  # fmt: skip
        result = measure(config)
    except (ConfigError, BenchError) as exc:
        raise SystemExit(f"host_ceiling: {exc}") from None
    print(f"{config.backend} on {config.device}, {result['bytes'] / 2**20:.0f} MiB per round, median GB/s:")
    for mode, values in result["gbps"].items():
        print(f"  {mode:<21} {statistics.median(values):8.2f}")
    print(f"chunked / raw: {result['chunked_over_raw']:.3f}   ceiling (chunked+copies / raw): {result['ceiling']:.3f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
