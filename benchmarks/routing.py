"""The router's policies side by side over real vLLM servers: prefix-aware and load-aware against round robin.

Starts `kvstage bootstrap`, a vLLM prefill server P (TP=1) and three vLLM decode servers (TP=1) with kvstage's
connector: DA and DB alike, and DC slowed (`--max-num-seqs 2`: at most two requests at once, as with a smaller
KV cache). In front of them, four `kvstage router` processes: round robin and `--policy prefix` over P, DA, DB;
round robin and `--policy load` over P, DA, DC. Then, `--runs` times, each experiment runs both of its routers
one after the other (the order alternates from run to run), every prefix cache emptied before each:

- prefix: `--prefixes` shared prefixes of `--prefix-tokens` tokens, `--per-prefix` requests each (a prefix and a
  distinct tail of `--tail-tokens`), in one seeded random order, `--concurrency` at a time, `--max-tokens` each;
- load: `--load-requests` prompts of `--load-tokens` random tokens, `--load-max-tokens` tokens each, or
  `--load-long-max-tokens` for a `--load-long-share` of them (all ignore_eos), `--load-concurrency` at a time.

Each run draws new prompts (from `--seed` and the run's number), the same for both routers of the run: the prefix
router's index never knows a run's prefixes before it starts, as the decodes' emptied caches do not.

Per run and router it measures TTFT per request (arrival of the first streamed token at the client), and the KV
bytes kvstage moved: the decodes' `vllm:prompt_tokens_by_source{source="external_kv_transfer"}` before and after,
times the KV bytes of a token (from the bootstrap's layout). It prints, and writes to `--out` as JSON, the medians
over the runs with their min-max, and the ratio of each policy to round robin per run (its median and min-max).
Every request must succeed; a failed one is counted and reported.

    flock /work/vllm.lock python benchmarks/routing.py --runs 5 --out routing.json
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from kvstage.e2e.model import TinyModelSpec, build_tiny_model
from kvstage.e2e.servers import (
    ManagedProcess,
    VLLMServerSpec,
    free_port,
    start_bootstrap,
    start_router,
    start_vllm,
)
from kvstage.router.vllm_metrics import parse_vllm_metrics
from kvstage.transport.bootstrap import BootstrapClient

START_TIMEOUT_S = 900.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--per-prefix", type=int, default=16)
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--load-requests", type=int, default=48)
    parser.add_argument("--load-tokens", type=int, default=256)
    parser.add_argument("--load-max-tokens", type=int, default=16)
    parser.add_argument("--load-long-max-tokens", type=int, default=256)
    parser.add_argument("--load-long-share", type=float, default=0.25)
    parser.add_argument("--load-concurrency", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the summary here as JSON")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the servers' logs here")
    return parser.parse_args()


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Sample:
    """One run of one router over one workload."""

    ttft_p50_ms: float
    ttft_p90_ms: float
    kv_bytes: int
    failed: int
    seconds: float


def prefix_workload(args: argparse.Namespace, vocab: int, run: int) -> list[Request]:
    rng = random.Random(f"prefix {args.seed} {run}")
    prefixes = [[rng.randrange(2, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    requests = [
        Request([*prefix, *(rng.randrange(2, vocab) for _ in range(args.tail_tokens))], args.max_tokens)
        for prefix in prefixes
        for _ in range(args.per_prefix)
    ]
    rng.shuffle(requests)
    return requests


def load_workload(args: argparse.Namespace, vocab: int, run: int) -> list[Request]:
    rng = random.Random(f"load {args.seed} {run}")
    return [
        Request(
            [rng.randrange(2, vocab) for _ in range(args.load_tokens)],
            args.load_long_max_tokens if rng.random() < args.load_long_share else args.load_max_tokens,
        )
        for _ in range(args.load_requests)
    ]


def ttft_s(url: str, request: Request) -> float | None:
    """Seconds to the first streamed token through the router, or None when the request failed."""
    body = {
        "model": "tiny",
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as reply:
        if reply.status_code != 200:
            return None
        for line in reply.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
    return first


def external_tokens(urls: Sequence[str]) -> float:
    """The decodes' prompt tokens loaded through their connector, summed."""
    total = 0.0
    for url in urls:
        load = parse_vllm_metrics(httpx.get(f"{url}/metrics", timeout=10.0).text)
        if load.external_tokens is None:
            raise RuntimeError(f"{url}/metrics has no vllm:prompt_tokens_by_source: another vLLM version?")
        total += load.external_tokens
    return total


def reset_caches(urls: Sequence[str]) -> None:
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=30.0).raise_for_status()


def run_once(
    router: str,
    servers: Sequence[str],
    decodes: Sequence[str],
    requests: list[Request],
    *,
    concurrency: int,
    token_bytes: int,
) -> Sample:
    reset_caches(servers)
    before = external_tokens(decodes)
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        times = list(pool.map(lambda r: ttft_s(router, r), requests))
    seconds = time.monotonic() - started
    time.sleep(1.0)  # vLLM's counters follow its engine steps
    moved = (external_tokens(decodes) - before) * token_bytes
    ok = sorted(t for t in times if t is not None)
    if not ok:
        raise RuntimeError(f"every request through {router} failed")
    p90 = ok[min(len(ok) - 1, int(0.9 * len(ok)))]
    return Sample(statistics.median(ok) * 1e3, p90 * 1e3, int(moved), len(times) - len(ok), seconds)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@contextmanager
def cluster(args: argparse.Namespace, work: Path) -> Iterator[dict[str, Any]]:
    """The servers and the four routers; everything stopped at the end."""
    model = build_tiny_model(TinyModelSpec(), work / "cache")
    with ExitStack() as stack:
        bootstrap = start_bootstrap(work / "logs")
        stack.callback(bootstrap.stop)
        bootstrap.wait_ready(60.0)

        def server(role: str, name: str, extra: tuple[str, ...] = ()) -> VLLMServerSpec:
            return VLLMServerSpec(role, name, 1, free_port(), model, bootstrap.url, dev_mode=True, extra_args=extra)

        specs = {
            "P": server("prefill", "P"),
            "DA": server("decode", "DA"),
            "DB": server("decode", "DB"),
            "DC": server("decode", "DC", ("--max-num-seqs", "2")),
        }
        procs: list[ManagedProcess] = []
        for spec in specs.values():
            procs.append(start_vllm(spec, work / "logs"))
            stack.callback(procs[-1].stop)
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc in procs:
            proc.wait_ready(max(1.0, deadline - time.monotonic()))

        def router(name: str, decodes: tuple[str, str], policy: str) -> str:
            log = work / "logs" / f"router-{name}.log"
            proc = start_router(bootstrap.url, [specs["P"]], [specs[d] for d in decodes], log, ("--policy", policy))
            stack.callback(proc.stop)
            proc.wait_ready(60.0)
            return proc.url

        client = BootstrapClient(bootstrap.url)
        token_bytes = client.lookup_instance("DA", "decode")[0].layout.to_layout().bytes_per_token()
        client.close()
        yield {
            "specs": specs,
            "token_bytes": token_bytes,
            "routers": {
                "prefix": {
                    "round_robin": router("rr-ab", ("DA", "DB"), "round_robin"),
                    "prefix": router("prefix", ("DA", "DB"), "prefix"),
                },
                "load": {
                    "round_robin": router("rr-ac", ("DA", "DC"), "round_robin"),
                    "load": router("load", ("DA", "DC"), "load"),
                },
            },
        }


def experiment(
    name: str,
    routers: dict[str, str],
    servers: list[str],
    decodes: list[str],
    workload: Callable[[int], list[Request]],
    concurrency: int,
    runs: int,
    token_bytes: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    samples: dict[str, list[Sample]] = {policy: [] for policy in routers}
    for run in range(runs):
        order = list(routers) if run % 2 == 0 else list(reversed(routers))
        requests = workload(run)  # new prompts every run: no router starts a run knowing them
        for policy in order:
            sample = run_once(
                routers[policy], servers, decodes, requests, concurrency=concurrency, token_bytes=token_bytes
            )
            samples[policy].append(sample)
            say(f"{name} run {run + 1}/{runs} {policy}: {asdict(sample)}")
    base = samples["round_robin"]
    summary: dict[str, Any] = {}
    for policy, got in samples.items():
        summary[policy] = {
            field: spread([getattr(s, field) for s in got])
            for field in ("ttft_p50_ms", "ttft_p90_ms", "kv_bytes", "seconds")
        }
        summary[policy]["failed"] = sum(s.failed for s in got)
        if policy != "round_robin":
            summary[policy]["vs_round_robin"] = {
                "kv_bytes": spread([s.kv_bytes / max(b.kv_bytes, 1) for s, b in zip(got, base, strict=True)]),
                "ttft_p50": spread([s.ttft_p50_ms / b.ttft_p50_ms for s, b in zip(got, base, strict=True)]),
                "ttft_p90": spread([s.ttft_p90_ms / b.ttft_p90_ms for s, b in zip(got, base, strict=True)]),
            }
    return {"samples": {p: [asdict(s) for s in got] for p, got in samples.items()}, "summary": summary}


def table(name: str, result: dict[str, Any]) -> str:
    def cell(value: dict[str, float], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        low, mid, high = (fmt.format(value[k] / scale) for k in ("min", "median", "max"))
        return f"{mid} ({low}-{high})"

    lines = [
        f"{name}: median (min-max)",
        "| policy | TTFT p50 ms | TTFT p90 ms | KV moved KiB | failed | vs round robin: KV, p50, p90 |",
        "|---|---|---|---|---|---|",
    ]
    for policy, s in result["summary"].items():
        vs = s.get("vs_round_robin")
        ratios = (
            "" if vs is None else ", ".join(cell(vs[k], fmt="{:.2f}") for k in ("kv_bytes", "ttft_p50", "ttft_p90"))
        )
        cells = [cell(s["ttft_p50_ms"]), cell(s["ttft_p90_ms"]), cell(s["kv_bytes"], 1024), str(s["failed"]), ratios]
        lines.append(f"| {policy} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: every server started is stopped


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    say = lambda line: print(line, flush=True)  # noqa: E731
    with ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstage-routing-")))
        with cluster(args, work) as c:
            specs = c["specs"]
            vocab = TinyModelSpec().vocab_size
            urls = {name: spec.url for name, spec in specs.items()}
            results = {
                "prefix": experiment(
                    "prefix",
                    c["routers"]["prefix"],
                    [urls["P"], urls["DA"], urls["DB"]],
                    [urls["DA"], urls["DB"]],
                    partial(prefix_workload, args, vocab),
                    args.concurrency,
                    args.runs,
                    c["token_bytes"],
                    say,
                ),
                "load": experiment(
                    "load",
                    c["routers"]["load"],
                    [urls["P"], urls["DA"], urls["DC"]],
                    [urls["DA"], urls["DC"]],
                    partial(load_workload, args, vocab),
                    args.load_concurrency,
                    args.runs,
                    c["token_bytes"],
                    say,
                ),
            }
    for name, result in results.items():
        say(table(name, result))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}, indent=2))


if __name__ == "__main__":
    main()
