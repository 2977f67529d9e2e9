"""`kvstage demo`, the vLLM demo: prompts in, tokens out, through a vLLM prefill instance and a vLLM decode
instance of two TP sizes, with kvstage moving the KV between them (staged, or direct where the sizes match); every
request verified twice.

Owns `DemoOptions`, `DemoReport` and `run_demo`, which:
1. builds the tiny local model once (kvstage.e2e.model) and starts `kvstage bootstrap` (unless `bootstrap` names a
   directory to use, such as an etcd), a vLLM prefill server (TP = prefill_tp), a vLLM decode server
   (TP = decode_tp), both with `KVStageConnector`, and the `kvstage router` in front of them: on the loopback
   address, or with `hosts = 3` on three hosts made of network namespaces (kvstage.e2e.hosts): prefill on A,
   decode on B, the bootstrap and the router on C, each reached at its own address, under a shared secret drawn
   for the run;
2. runs every prompt once on the decode server alone (a single-instance vLLM run: the reference), then clears
   its prefix cache so that the handoff starts cold;
3. sends every prompt through the router with the `openai` client, streamed, timing the first token;
4. verifies each request (a) bit for bit: the KV decode received equals prefill's, per page, layer, K/V and head
   (digests the connector writes into the run's report folder), and (b) by its tokens: the greedy float32
   completion equals the reference's;
5. reads the ranks' counters (bytes, transfer operations, ring high water, ring bytes still live) and stops
   every process.

With `shared_prefix_tokens = N`, every prompt starts with the same N tokens; the first request goes alone, so the
others find those tokens in decode's prefix cache and kvstage moves only the rest.
Called by the `kvstage demo` command (cli.py).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvstage.demo.summary import summary_table
from kvstage.e2e.hosts import HostNet
from kvstage.e2e.model import MODELS, TinyModelSpec, build_tiny_model
from kvstage.e2e.servers import (
    LOCAL,
    Placement,
    VLLMServerSpec,
    free_port,
    start_bootstrap,
    start_router,
    start_vllm,
)
from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters

#: Seconds a vLLM server may take to come up on a 2-core machine (about 55 s at TP 1, more at TP 2).
START_TIMEOUT_S = 420.0


@dataclass(frozen=True, slots=True)
class DemoOptions:
    prefill_tp: int = 2
    decode_tp: int = 1
    requests: int = 8
    backend: str = "local"
    prompt_tokens: int = 320
    shared_prefix_tokens: int = 0
    max_tokens: int = 16
    concurrency: int = 4
    seed: int = 1
    model: str = "llama-tiny"  # a name of kvstage.e2e.model.MODELS
    work_dir: Path | None = None  # logs and reports; a temporary folder (removed) when None
    bootstrap: str = ""  # the directory to use (tcp:// or etcd://); "" starts a `kvstage bootstrap` of its own
    hosts: int = 1  # 1: everything on this host's loopback; 3: prefill, decode and bootstrap+router on hosts A, B, C


@dataclass(frozen=True, slots=True)
class DemoReport:
    requests: int
    verified: int
    mismatches: int
    failed: int
    leaked_bytes: int
    kv_bytes: int
    prefix_bytes_saved: int
    transfer_gbps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    transfer_ops: int = 0
    ring_high_water_bytes: int = 0
    scatters: int = 0  # decode's copies out of its ring: none where every room went direct
    problems: tuple[str, ...] = field(default=())

    @property
    def path(self) -> str:
        """How the KV moved: "direct" (page runs into decode's vLLM blocks, no ring) or "staged"."""
        return "direct" if self.transfer_ops and not self.scatters and not self.ring_high_water_bytes else "staged"

    @property
    def ok(self) -> bool:
        return self.verified == self.requests and not self.mismatches and not self.failed and not self.leaked_bytes

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["problems"] = list(self.problems)
        out["path"] = self.path
        return out


@dataclass(frozen=True, slots=True)
class _Answer:
    text: str
    ttft_s: float
    tokens: int = 0  # completion tokens, as the server counted them
    error: str = ""


def make_prompts(options: DemoOptions, vocab_size: int) -> list[list[int]]:
    """Token-id prompts of `prompt_tokens` tokens; the first `shared_prefix_tokens` are the same in all."""
    rng = random.Random(options.seed)
    low = 2  # 0 and 1 are <s> and </s>
    shared = [rng.randrange(low, vocab_size) for _ in range(options.shared_prefix_tokens)]
    rest = options.prompt_tokens - len(shared)
    return [shared + [rng.randrange(low, vocab_size) for _ in range(rest)] for _ in range(options.requests)]


class _Stage:
    """A progress display on stderr: one line per stage, with its duration."""

    def __init__(self, quiet: bool) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, quiet=quiet)

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        start = time.monotonic()
        with self.console.status(what + " ..."):
            yield
        self.console.log(f"{what}: {time.monotonic() - start:.1f} s")


def run_demo(options: DemoOptions = DemoOptions(), *, quiet: bool = False) -> DemoReport:
    if options.hosts > 1 and options.backend == "local":
        raise ValueError("the local backend moves KV within one host: across hosts, use mooncake or nixl")
    stage = _Stage(quiet)
    with contextlib.ExitStack() as stack:
        work = options.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstage-demo-")))
        reports = work / "reports"
        spec = MODELS[options.model]
        with stage(f"building the tiny model {options.model} (cached after the first run)"):
            model = build_tiny_model(spec)
        logs = work / "logs"
        prefill_at, decode_at, control_at = _placements(options.hosts, stack)
        directory = options.bootstrap or _start_bootstrap(stack, logs, control_at)
        servers = _server_specs(options, model, directory, reports, (prefill_at, decode_at))
        procs = [start_vllm(s, logs) for s in servers]
        for proc in procs:
            stack.callback(proc.stop)
        with stage(f"starting vLLM prefill (TP={options.prefill_tp}) and decode (TP={options.decode_tp})"):
            for proc in procs:
                proc.wait_ready(START_TIMEOUT_S)
        router = start_router(directory, [servers[0]], [servers[1]], logs / "router.log", placement=control_at)
        stack.callback(router.stop)
        with stage("starting the router"):
            router.wait_ready(60.0)
        prompts = make_prompts(options, spec.vocab_size)
        with stage(f"reference: {len(prompts)} prompts on the decode server alone"):
            reference = _run_all(servers[1].url, prompts, options, concurrency=options.concurrency)
            httpx.post(f"{servers[1].url}/reset_prefix_cache", timeout=30.0).raise_for_status()
        with stage(f"disaggregated: {len(prompts)} prompts through the router"):
            start = time.monotonic()
            answers = _run_all(router.url, prompts[:1], options, concurrency=1)
            answers += _run_all(router.url, prompts[1:], options, concurrency=options.concurrency)
            elapsed = time.monotonic() - start
        with stage("collecting the ranks' reports"):
            _wait_for_reports(reports, len(prompts), options.decode_tp)
        return _report(spec, reports, reference, answers, elapsed)
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow exceptions


def _start_bootstrap(stack: contextlib.ExitStack, logs: Path, placement: Placement) -> str:
    bootstrap = start_bootstrap(logs, placement)
    stack.callback(bootstrap.stop)
    bootstrap.wait_ready(60.0)
    return bootstrap.url


def _placements(hosts: int, stack: contextlib.ExitStack) -> tuple[Placement, Placement, Placement]:
    """Where prefill, decode, and the bootstrap with the router run: all here, or on hosts A, B and C (made now,
    removed when `stack` closes)."""
    if hosts == 1:
        return LOCAL, LOCAL, LOCAL
    if hosts != 3:
        raise ValueError(f"the demo runs on 1 or 3 hosts, not {hosts}")
    net = stack.enter_context(HostNet())
    secret = secrets.token_hex(16)
    a, b, c = (net.placement(name, secret) for name in net.hosts)
    return a, b, c


def _server_specs(
    options: DemoOptions, model: Path, bootstrap: str, reports: Path, where: tuple[Placement, Placement]
) -> tuple[VLLMServerSpec, VLLMServerSpec]:
    def spec(role: str, tp: int, placement: Placement) -> VLLMServerSpec:
        return VLLMServerSpec(
            role,
            role,
            tp,
            free_port(),
            model,
            bootstrap,
            backend=options.backend,
            report_dir=str(reports),
            dev_mode=role == "decode",
            placement=placement,
        )

    return spec("prefill", options.prefill_tp, where[0]), spec("decode", options.decode_tp, where[1])


def _run_all(url: str, prompts: list[list[int]], options: DemoOptions, *, concurrency: int) -> list[_Answer]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="kvstage-demo", max_retries=0, timeout=300.0)
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: _complete(client, p, options.max_tokens), prompts))


def _complete(client: object, prompt: list[int], max_tokens: int) -> _Answer:
    from openai import APIError, OpenAI

    assert isinstance(client, OpenAI)
    start = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    tokens = 0
    try:
        stream = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if first is None:
                first = time.monotonic() - start
            parts.extend(choice.text for choice in chunk.choices)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except APIError as exc:
        return _Answer("", 0.0, error=f"{type(exc).__name__}: {exc}")
    return _Answer("".join(parts), first or 0.0, tokens)


def _wait_for_reports(folder: Path, rooms: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(decode_rooms(folder)) < rooms:
        time.sleep(0.2)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _report(
    spec: TinyModelSpec,
    folder: Path,
    reference: list[_Answer],
    answers: list[_Answer],
    elapsed: float,
) -> DemoReport:
    check = check_rooms(folder, num_layers=spec.num_layers, num_kv_heads=spec.kv_heads)
    counters = read_counters(folder)
    problems = [f"room {room}: {why}" for room, why in sorted(check.mismatched.items())]
    failed = [a.error for a in answers if a.error]
    problems += failed
    token_mismatch = [
        i for i, (a, r) in enumerate(zip(answers, reference, strict=True)) if not a.error and a.text != r.text
    ]
    problems += [f"request {i}: tokens differ from the single-instance run" for i in token_mismatch]
    verified = min(len(check.verified), len(answers) - len(failed) - len(token_mismatch))
    kv_bytes = sum(int(c["kvstage_transfer_bytes_total"]) for (role, _), c in counters.items() if role == "prefill")
    busy = max((c["kvstage_transfer_busy_seconds_total"] for c in counters.values()), default=0.0)
    room_failures = sum(int(c["kvstage_room_failures_total"]) for c in counters.values())
    ttfts = [a.ttft_s * 1000 for a in answers if not a.error]
    return DemoReport(
        requests=len(answers),
        verified=verified,
        mismatches=len(check.mismatched) + len(token_mismatch),
        failed=len(failed) + room_failures,
        leaked_bytes=sum(int(c["kvstage_ring_live_bytes"]) for c in counters.values()),
        kv_bytes=kv_bytes,
        prefix_bytes_saved=sum(check.prefix_tokens.values()) * spec.kv_bytes_per_token,
        transfer_gbps=kv_bytes / busy / 1e9 if busy else 0.0,
        ttft_p50_ms=_percentile(ttfts, 50),
        ttft_p99_ms=_percentile(ttfts, 99),
        tokens_per_s=sum(a.tokens for a in answers) / elapsed if elapsed else 0.0,
        transfer_ops=sum(int(c["kvstage_transfer_ops_total"]) for c in counters.values()),
        ring_high_water_bytes=max((int(c["kvstage_ring_high_water_bytes"]) for c in counters.values()), default=0),
        scatters=sum(int(c["kvstage_copy_seconds_count"]) for (role, _), c in counters.items() if role == "decode"),
        problems=tuple(problems),
    )


def print_summary(report: DemoReport, options: DemoOptions) -> None:
    from rich.console import Console

    rows = [
        ("requests", f"{report.requests}"),
        ("verified (KV bit-exact and tokens equal)", f"{report.verified}"),
        ("mismatches", f"{report.mismatches}"),
        ("failed", f"{report.failed}"),
        ("leaked ring bytes", f"{report.leaked_bytes}"),
        ("TTFT p50 / p99", f"{report.ttft_p50_ms:.0f} / {report.ttft_p99_ms:.0f} ms"),
        ("tokens/s", f"{report.tokens_per_s:.1f}"),
        ("KV bytes moved", f"{report.kv_bytes:,}"),
        ("KV bytes saved by decode's prefix cache", f"{report.prefix_bytes_saved:,}"),
        ("path", "direct: page runs into decode's vLLM blocks" if report.path == "direct" else "staged: ring"),
        ("transfer ops", f"{report.transfer_ops}"),
        ("transfer rate", f"{report.transfer_gbps:.2f} GB/s"),
        ("ring high water", f"{report.ring_high_water_bytes:,} B"),
    ]
    console = Console()
    title = f"kvstage demo ({options.model}): vLLM prefill TP={options.prefill_tp} -> decode TP={options.decode_tp}"
    console.print(summary_table(rows, title))
    for problem in report.problems:
        console.print(f"[red]{problem}[/red]")
