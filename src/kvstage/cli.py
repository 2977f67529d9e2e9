"""The `kvstage` command line: `demo`, `sim`, `bench`, `bootstrap` and `router`.

Owns argument parsing and nothing else; each command imports its implementation lazily so that
`kvstage --help` stays fast and a missing optional transport never breaks unrelated commands.
The services (`bootstrap`, `router`) bind the loopback address by default and refuse a non-loopback address
unless a secret is given (`KVSTAGE_SECRET` or `--secret-file`) or `--insecure` opts out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

if TYPE_CHECKING:
    from kvstage.bench.config import BenchConfig

log = logging.getLogger("kvstage.cli")
_T = TypeVar("_T")

app = typer.Typer(
    name="kvstage",
    help="Hand the KV cache from prefill to decode workers across different TP sizes, through a staging ring.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _commands() -> None:
    """Hand the KV cache from prefill to decode workers across different TP sizes, through a staging ring."""


def main() -> None:
    app()


@app.command()
def demo(
    synthetic: bool = typer.Option(
        False, "--synthetic", help="The fast demo without vLLM: kvstage's own agents and pools, byte-level checks."
    ),
    prefill_tp: int = typer.Option(2, "--prefill-tp", min=1, help="TP size of the vLLM prefill server."),
    decode_tp: int = typer.Option(1, "--decode-tp", min=1, help="TP size of the vLLM decode server."),
    requests: int = typer.Option(8, "--requests", min=1, help="How many requests to send."),
    backend: str = typer.Option("local", "--backend", help="Data transport: local, mooncake or nixl."),
    prompt_tokens: int = typer.Option(320, "--prompt-tokens", min=2, help="Prompt length of every request."),
    shared_prefix_tokens: int = typer.Option(
        0, "--shared-prefix-tokens", min=0, help="Requests share a system prompt of this many tokens."
    ),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Tokens to generate per request."),
    hosts: int = typer.Option(
        1,
        "--hosts",
        min=1,
        max=3,
        help="1: all on this host's loopback. 3: prefill, decode, and bootstrap+router each on a host of its own "
        "(network namespaces joined by veth links; needs root).",
    ),
    model: str = typer.Option(
        "llama-tiny",
        "--model",
        help="The tiny local model: llama-tiny (GQA) or deepseek-tiny (a DeepSeek-V2-shaped MLA model; vLLM's CPU "
        "MLA serves it without a prefix cache, so --shared-prefix-tokens moves every token).",
    ),
    work_dir: Annotated[
        Path | None, typer.Option("--work-dir", help="Keep the servers' logs and reports here.")
    ] = None,
    json_output: bool = typer.Option(False, "--json", help="Print the summary as one JSON line at the end."),
    bootstrap: str = typer.Option(
        "",
        "--bootstrap",
        help="Register with this directory (tcp://HOST:PORT or etcd://HOST:PORT/NAMESPACE) instead of starting a "
        "kvstage bootstrap.",
    ),
) -> None:
    """Run the end-to-end demo: a vLLM prefill server and a vLLM decode server (of different TP sizes: staged; of
    one: direct) behind the kvstage router, the tiny local model, every request verified (KV bit-exact, tokens equal
    to one instance)."""
    if synthetic:
        from kvstage.demo.synthetic import DemoConfig, print_report, run_demo

        report = run_demo(DemoConfig(bootstrap=bootstrap))
        print_report(report)
        if not report.ok:
            raise typer.Exit(code=1)
        return
    import json

    from kvstage.demo.vllm import DemoOptions, print_summary
    from kvstage.demo.vllm import run_demo as run_vllm
    from kvstage.e2e.model import MODELS

    if hosts == 2:
        raise typer.BadParameter("1 or 3", param_hint="--hosts")
    if hosts == 3 and backend == "local":
        raise typer.BadParameter("local moves KV within one host: use mooncake or nixl", param_hint="--backend")
    if model not in MODELS:
        raise typer.BadParameter(f"one of {', '.join(MODELS)}", param_hint="--model")
    if shared_prefix_tokens >= prompt_tokens:
        raise typer.BadParameter("must be below --prompt-tokens", param_hint="--shared-prefix-tokens")
    options = DemoOptions(
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        requests=requests,
        backend=backend,
        prompt_tokens=prompt_tokens,
        shared_prefix_tokens=shared_prefix_tokens,
        max_tokens=max_tokens,
        model=model,
        work_dir=work_dir,
        bootstrap=bootstrap,
        hosts=hosts,
    )
    vllm = run_vllm(options)
    print_summary(vllm, options)
    if json_output:
        print(json.dumps(vllm.to_json()))
    if not vllm.ok:
        raise typer.Exit(code=1)


@app.command()
def sim(
    seeds: int = typer.Option(100, "--seeds", min=1, help="How many seeds to run."),
    seed_start: int = typer.Option(0, "--seed-start", min=0, help="First seed."),
    faults: str = typer.Option("default", "--faults", help="Fault level: none, default or heavy."),
    prefill_tp: int | None = typer.Option(None, "--prefill-tp", min=1, help="Pin every prefill instance's TP size."),
    decode_tp: int | None = typer.Option(None, "--decode-tp", min=1, help="Pin every decode instance's TP size."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="Pin the model's KV head count."),
    rooms: int = typer.Option(12, "--rooms", min=1, help="Rooms per seed."),
    payloads: bool = typer.Option(
        True, "--payloads/--no-payloads", help="Move real KV bytes (checks D1), or only ownership tags (fast)."
    ),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Worker processes; results are identical for any count."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on the last stdout line."),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Run (replay) this one seed."),
    trace: bool = typer.Option(False, "--trace", help="With --seed: print every event of the run."),
) -> None:
    """Run the real protocol endpoints through seeded faults and check the invariants after every step."""
    from kvstage.errors import ConfigError
    from kvstage.sim.console import main as sim_main
    from kvstage.sim.scenario import SimConfig

    config = SimConfig(
        faults=faults, payloads=payloads, prefill_tp=prefill_tp, decode_tp=decode_tp, kv_heads=kv_heads, rooms=rooms
    )
    try:
        config.profile  # noqa: B018 - validates --faults before any world is built
        code = sim_main(
            config, seeds=seeds, seed_start=seed_start, jobs=jobs, as_json=as_json, trace_seed=seed, show_trace=trace
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(code=code)


@app.command()
def bench(
    backend: str = typer.Option("local", "--backend", help="Data transport: local, mooncake, nixl or cuda_ipc."),
    model: str = typer.Option(
        "llama3-8b", "--model", help="llama3-8b, llama3-70b, qwen2.5-7b, tiny, or a shape like L32xH8xD128:bfloat16."
    ),
    prefill_tp: int = typer.Option(4, "--prefill-tp", min=1, help="Prefill TP size (one process per rank)."),
    decode_tp: int = typer.Option(2, "--decode-tp", min=1, help="Decode TP size (one process per rank)."),
    page_size: int = typer.Option(16, "--page-size", min=1, help="Tokens per KV page."),
    tokens: int = typer.Option(4096, "--tokens", min=1, help="Tokens per request."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", min=1, help="Staging chunk grid (a page multiple)."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Requests in flight at once."),
    repeats: int | None = typer.Option(
        None,
        "--repeats",
        min=1,
        help="Timed rounds per path (best and median reported; staged/raw paired per round); default 3. With "
        "--handoff: timed rooms per latency scenario, default 10.",
    ),
    device: str = typer.Option(
        "cpu",
        "--device",
        help="Where the KV pools live: cpu, or cuda (staging on the GPU with cuda_ipc, nixl; else host).",
    ),
    ring_chunks: int = typer.Option(
        4, "--ring-chunks", min=1, help="Chunk regions per decode ring (and chunks per prefill staging slab)."
    ),
    writes_per_peer: int = typer.Option(
        2,
        "--writes-per-peer",
        min=1,
        help="Prefill writes in flight per decode rank; the raw path splits each pair's bytes into as many.",
    ),
    slice_rounds: int | None = typer.Option(
        None,
        "--slice-rounds",
        min=1,
        help="Time the per-slice path in the first N rounds only (default: every round); it is slow on GPUs.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on the last stdout line."),
    plot_file: str | None = typer.Option(None, "--plot", help="Write a bar chart (PNG) to this file."),
    handoff: bool = typer.Option(
        False,
        "--handoff",
        help="Instead of the throughput paths: one request's last-chunk handoff latency, CPU per chunk and the "
        "decode engine's step time while transfers run (docs/benchmarks.md).",
    ),
    gap_ms: float | None = typer.Option(
        None, "--gap-ms", help="--handoff: ms between chunk releases (default 20 on cpu, 5 on cuda)."
    ),
    chunk_rate_hz: float = typer.Option(
        500.0, "--chunk-rate-hz", help="--handoff: chunks released per second while rooms stream past the engine."
    ),
    stream_s: float = typer.Option(
        2.0, "--stream-s", help="--handoff: seconds of engine steps alone, and of chunks streamed past it."
    ),
) -> None:
    """Measure staged (through the agents) vs direct per-slice vs raw bulk: same backend, same bytes, one run.
    With --handoff, measure what a user feels instead: latency, CPU per chunk and engine interference."""
    from pathlib import Path

    from rich.console import Console

    from kvstage.bench import BenchConfig, BenchError
    from kvstage.bench.report import json_line, plot, print_table, run_with_progress
    from kvstage.errors import ConfigError

    if handoff and (slice_rounds is not None or plot_file):
        raise typer.BadParameter("--handoff takes neither --slice-rounds nor --plot")
    try:
        config = BenchConfig(
            backend,
            model,
            prefill_tp,
            decode_tp,
            page_size,
            tokens,
            chunk_tokens,
            concurrency,
            repeats or (10 if handoff else 3),
            device=device,
            ring_chunks=ring_chunks,
            writes_per_peer=writes_per_peer,
            slice_rounds=slice_rounds,
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if handoff:
        _bench_handoff(config, gap_ms, chunk_rate_hz, stream_s, as_json)
        return
    result = _measured(lambda: run_with_progress(config), BenchError)
    print_table(result, Console())
    if plot_file:
        plot(result, Path(plot_file))
    if as_json:
        typer.echo(json_line(result))


def _bench_handoff(
    config: BenchConfig, gap_ms: float | None, chunk_rate_hz: float, stream_s: float, as_json: bool
) -> None:
    """`kvstage bench --handoff`: the latency scenario (bench/handoff.py) on `config`."""
    from rich.console import Console

    from kvstage.bench.handoff import DEFAULT_GAP_MS, HandoffConfig, HandoffError
    from kvstage.bench.report import handoff_json_line, print_handoff_table, run_handoff_with_progress
    from kvstage.errors import ConfigError

    try:
        gap = DEFAULT_GAP_MS[config.device] if gap_ms is None else gap_ms
        handoff = HandoffConfig(config, gap / 1e3, chunk_rate_hz, stream_s)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    result = _measured(lambda: run_handoff_with_progress(handoff), HandoffError)
    print_handoff_table(result, Console())
    if as_json:
        typer.echo(handoff_json_line(result))


def _measured(run: Callable[[], _T], failure: type[Exception]) -> _T:
    """`run()`'s result; its `failure` (a bench that could not measure) is said on stderr and exits 1."""
    try:
        return run()
    except failure as exc:
        typer.echo(f"bench failed: {exc}", err=True)
        raise typer.Exit(code=1) from exc


def _start_service(service: str, endpoint: str, secret_file: str | None, insecure: bool) -> bytes | None:
    """Log to stderr and load the shared secret (None without one); a bad secret, or an open bind without one and
    without `--insecure`, exits 2 naming what is needed. An open bind under `--insecure` is logged as a warning."""
    from kvstage.errors import ConfigError
    from kvstage.transport.auth import check_bind, is_loopback_endpoint, load_secret

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        secret = load_secret(secret_file)
        check_bind(endpoint, secret is not None, insecure, f"kvstage {service}")
    except ConfigError as exc:
        typer.echo(f"kvstage {service}: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if secret is None and not is_loopback_endpoint(endpoint):
        log.warning(
            "%s listens on %s without a secret (--insecure): anyone who reaches it can use it", service, endpoint
        )
    return secret


def _zmq_address(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{port if port else '*'}"


_HOST_HELP = "Address to bind; a non-loopback address needs a secret or --insecure."
_SECRET_FILE_HELP = "File holding the shared secret, at least 16 bytes (else $KVSTAGE_SECRET)."
_INSECURE_HELP = "Allow a non-loopback bind without a secret (logged as a warning)."


@app.command()
def bootstrap(
    host: str = typer.Option("127.0.0.1", "--host", help=_HOST_HELP),
    port: int = typer.Option(7100, "--port", min=0, max=65535, help="Port to bind (0: any free port)."),
    secret_file: str | None = typer.Option(None, "--secret-file", help=_SECRET_FILE_HELP),
    insecure: bool = typer.Option(False, "--insecure", help=_INSECURE_HELP),
) -> None:
    """Run the bootstrap (rendezvous) service on its own until SIGINT or SIGTERM."""
    import signal
    import threading

    from kvstage.errors import TransportError
    from kvstage.transport.bootstrap import BootstrapServer

    bind = _zmq_address(host, port)
    secret = _start_service("bootstrap", bind, secret_file, insecure)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    try:
        server = BootstrapServer(bind, secret=secret, insecure=insecure).start()
    except TransportError as exc:
        typer.echo(f"kvstage bootstrap: {exc}", err=True)
        raise typer.Exit(code=1) from exc
    log.info("bootstrap listening on %s", server.address)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
    log.info("bootstrap stopped")


@app.command()
def router(
    bootstrap: Annotated[
        str,
        typer.Option(
            "--bootstrap",
            help="The directory: kvstage bootstrap (tcp://HOST:PORT) or etcd (etcd://HOST:PORT/NAMESPACE).",
        ),
    ],
    prefill: Annotated[
        list[str] | None,
        typer.Option("--prefill", help="A prefill vLLM server, NAME=URL (NAME as it registered); repeat."),
    ] = None,
    decode: Annotated[
        list[str] | None,
        typer.Option("--decode", help="A decode vLLM server, NAME=URL (NAME as it registered); repeat."),
    ] = None,
    discover: bool = typer.Option(
        False,
        "--discover",
        help="Also route to every instance registered with the bootstrap that publishes its URL, as they come and go.",
    ),
    policy: str = typer.Option(
        "round_robin", "--policy", help="How instances are chosen: round_robin, load (least load) or prefix."
    ),
    block_tokens: int = typer.Option(
        128, "--block-tokens", min=1, help="Prefix policy: tokens per prompt block (vLLM's block size)."
    ),
    prefix_balance: float = typer.Option(
        1.25, "--prefix-balance", min=1.0, help="Prefix policy: no decode takes more than this times the mean load..."
    ),
    prefix_slack: int = typer.Option(4, "--prefix-slack", min=0, help="... plus this many requests."),
    host: str = typer.Option("127.0.0.1", "--host", help=_HOST_HELP),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to bind."),
    max_concurrent: int = typer.Option(256, "--max-concurrent", min=1, help="Requests in flight; more get 429."),
    max_body_bytes: int = typer.Option(8 * 2**20, "--max-body-bytes", min=1, help="Largest request body accepted."),
    connect_timeout: float = typer.Option(5.0, "--connect-timeout", min=0.001, help="Seconds to connect upstream."),
    read_timeout: float = typer.Option(
        600.0, "--read-timeout", min=0.001, help="Longest silence (seconds) from decode while it answers."
    ),
    prefill_timeout: float = typer.Option(
        300.0, "--prefill-timeout", min=0.001, help="Seconds a prefill request may take in all."
    ),
    max_attempts: int = typer.Option(
        3, "--max-attempts", min=1, help="Decode instances a request is tried on (a new room each) before it fails."
    ),
    probe_interval: float = typer.Option(
        2.0, "--probe-interval", min=0.01, help="Seconds between two /health probes of every instance."
    ),
    health_timeout: float = typer.Option(
        2.0, "--health-timeout", min=0.001, help="Seconds a /health probe (and a /v1/models request) may take."
    ),
    breaker_failures: int = typer.Option(
        3, "--breaker-failures", min=1, help="Failures in a row that take an instance out (its breaker opens)."
    ),
    breaker_cooldown: float = typer.Option(
        10.0, "--breaker-cooldown", min=0.0, help="Seconds an open breaker waits before one trial request."
    ),
    bootstrap_timeout: float = typer.Option(
        2.0, "--bootstrap-timeout", min=0.001, help="Seconds a TP size lookup from the bootstrap may take."
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="KVSTAGE_API_KEY",
        show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on /v1/* (prefer the environment variable).",
    ),
    upstream_api_key: str | None = typer.Option(
        None,
        "--upstream-api-key",
        envvar="KVSTAGE_UPSTREAM_API_KEY",
        show_envvar=True,
        help="Key sent to the vLLM servers (their --api-key); the client's Authorization is never forwarded.",
    ),
    secret_file: str | None = typer.Option(None, "--secret-file", help=_SECRET_FILE_HELP),
    insecure: bool = typer.Option(False, "--insecure", help=_INSECURE_HELP),
) -> None:
    """Serve OpenAI-compatible completions through one prefill and one decode vLLM server per request, retrying on
    another decode instance and falling back to decode alone when prefill fails. Instances are given with --prefill
    and --decode, found at runtime with --discover, or both."""
    from kvstage.errors import ConfigError
    from kvstage.router.app import serve
    from kvstage.router.config import RouterConfig
    from kvstage.router.instances import Instance, Role, parse_instance
    from kvstage.router.select import POLICIES
    from kvstage.transport.directory import open_directory

    secret = _start_service("router", _zmq_address(host, port), secret_file, insecure)
    try:
        open_directory(bootstrap).close()  # a malformed address fails here, not on every lookup
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--bootstrap") from exc

    def instances(specs: list[str], role: Role, flag: str) -> tuple[Instance, ...]:
        try:
            return tuple(parse_instance(spec, role) for spec in specs)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=flag) from exc

    if policy not in POLICIES:
        raise typer.BadParameter(f"expected one of {', '.join(POLICIES)}, got {policy!r}", param_hint="--policy")
    if not discover and not (prefill and decode):
        raise typer.BadParameter("give --prefill and --decode instances, or --discover", param_hint="--discover")
    config = RouterConfig(
        bootstrap=bootstrap,
        prefill=instances(prefill or [], "prefill", "--prefill"),
        decode=instances(decode or [], "decode", "--decode"),
        discover=discover,
        policy=policy,
        prefix_block_tokens=block_tokens,
        prefix_balance=prefix_balance,
        prefix_slack=prefix_slack,
        max_concurrent=max_concurrent,
        max_body_bytes=max_body_bytes,
        connect_timeout_s=connect_timeout,
        read_timeout_s=read_timeout,
        prefill_timeout_s=prefill_timeout,
        max_attempts=max_attempts,
        probe_interval_s=probe_interval,
        health_timeout_s=health_timeout,
        breaker_failures=breaker_failures,
        breaker_cooldown_s=breaker_cooldown,
        bootstrap_timeout_s=bootstrap_timeout,
        secret=secret,
        api_key=api_key or None,
        upstream_api_key=upstream_api_key or None,
    )
    serve(config, host, port)
