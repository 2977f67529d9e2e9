"""kvstage under vLLM across hosts: each host a network namespace with its own address (kvstage.e2e.hosts), prefill
on host A, decode on host B, the bootstrap and the router on host C, under a shared secret; KV crosses the A-B
link through Mooncake (TCP) or NIXL (UCX over TCP), never through a loopback address or shared memory.

One pair, P2 (TP=2, A) -> D1 (TP=1, B) over Mooncake, serves the whole module: every request verified (KV
bit-exact, tokens equal to decode alone), then the A-B link cut during transfers, shorter and longer than
`dead_after_s`, and in one direction only (nftables in A), each healed again. All are `slow` (opt-in): on the
shared 2-core host they start two vLLM servers (about 90 s) and, under heavy load, a prefill rank sometimes
declared decode dead without any cut, which would make the default run flaky. Decode keeps a canary in its
free ring bytes (`ring_canary`), so a write that lands after its room released the space is counted. The other
backend and TP pairs, and NIXL beside a CPU hog, are `kvstage demo --hosts 3` runs, also `slow`.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import random
import re
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvstage.demo.vllm import DemoOptions, run_demo
from kvstage.e2e.hosts import HostNet, namespaces_refused
from kvstage.e2e.model import TinyModelSpec, build_tiny_model
from kvstage.e2e.servers import (
    ManagedProcess,
    Placement,
    VLLMServerSpec,
    free_port,
    start_bootstrap,
    start_router,
    start_vllm,
)
from kvstage.e2e.verify import check_rooms, decode_rooms, read_counters

REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"no multi-host harness here: {REFUSED}")

ROOM_TIMEOUT_S = 30.0
DEAD_AFTER_S = 10.0
SHORT_CUT_S = 3.0  # < DEAD_AFTER_S: the peers ride it out, or rooms fail by their own timers
LONG_CUT_S = 15.0  # > DEAD_AFTER_S: each side declares the other dead
MAX_TOKENS = 8
#: Long prompts (4 chunks of 256 tokens) so that a cut finds transfers under way.
PROMPT_TOKENS = 1024
EXTRA_CONFIG = (
    ("room_timeout_s", ROOM_TIMEOUT_S),
    ("dead_after_s", DEAD_AFTER_S),
    ("ring_mib", 8),
    ("ring_canary", 1),
)
_FAILED = re.compile(r"kvstage room (\d+) \(request (\S+)\) failed: (.+)")
_ids = itertools.count()


@dataclass
class Hosts:
    net: HostNet
    prefill: VLLMServerSpec
    decode: VLLMServerSpec
    procs: dict[str, ManagedProcess]
    router: str
    reports: Path
    logs: Path
    spec: TinyModelSpec


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    root = tmp_path_factory.mktemp("hosts")
    spec = TinyModelSpec()
    model = build_tiny_model(spec, root / "cache")
    reports, logs = root / "reports", root / "logs"
    with HostNet() as net, contextlib.ExitStack() as stack:
        secret = secrets.token_hex(16)
        a, b, c = (net.placement(name, secret) for name in ("A", "B", "C"))
        bootstrap = start_bootstrap(logs, c)
        stack.callback(bootstrap.stop)
        bootstrap.wait_ready(60.0)

        def server(role: str, name: str, tp: int, placement: Placement) -> VLLMServerSpec:
            return VLLMServerSpec(
                role, name, tp, free_port(), model, bootstrap.url, backend="mooncake", report_dir=str(reports),
                dev_mode=True, extra_config=EXTRA_CONFIG, placement=placement,
            )  # fmt: skip

        prefill, decode = server("prefill", "P2", 2, a), server("decode", "D1", 1, b)
        procs = {s.instance: start_vllm(s, logs) for s in (prefill, decode)}
        for proc in procs.values():
            stack.callback(proc.stop)
        for proc in procs.values():
            proc.wait_ready(600.0)
        router = start_router(bootstrap.url, [prefill], [decode], logs / "router.log", placement=c)
        stack.callback(router.stop)
        router.wait_ready(60.0)
        routable(router.url)
        yield Hosts(net, prefill, decode, procs, router.url, reports, logs, spec)


def routable(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the router takes a request: right after its start it answers 503 until it has looked decode's
    TP size up at the bootstrap (seen on the loaded test host: about a second)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
    while httpx.post(f"{url}/v1/completions", json=body, timeout=ROOM_TIMEOUT_S * 4).status_code == 503:
        assert time.monotonic() < deadline, f"the router at {url} still answers 503 after {timeout_s:.0f} s"
        time.sleep(1.0)


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def complete(url: str, tokens: list[int], request_id: str = "") -> str:
    body = {"model": "tiny", "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    headers = {"X-Request-Id": request_id} if request_id else {}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=ROOM_TIMEOUT_S * 4)
    reply.raise_for_status()
    text: str = reply.json()["choices"][0]["text"]
    return text


def reference(h: Hosts, prompts: list[list[int]]) -> list[str]:
    """Each prompt on decode alone, from a cold prefix cache: the single-instance tokens."""
    out = []
    for tokens in prompts:
        httpx.post(f"{h.decode.url}/reset_prefix_cache", timeout=30.0).raise_for_status()
        out.append(complete(h.decode.url, tokens))
    httpx.post(f"{h.decode.url}/reset_prefix_cache", timeout=30.0).raise_for_status()
    return out


def wait_new_rooms(h: Hosts, before: set[int], count: int, timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(decode_rooms(h.reports) - before) < count:
        time.sleep(0.2)
    return decode_rooms(h.reports) - before


def assert_verified(h: Hosts, seeds: list[int], tokens: int = PROMPT_TOKENS) -> None:
    """Requests of `seeds` through the router: bit-exact KV in new rooms, the single-instance tokens."""
    prompts = [prompt(s, tokens) for s in seeds]
    want = reference(h, prompts)
    before = decode_rooms(h.reports)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(h.router, p), prompts))
    assert got == want
    rooms = wait_new_rooms(h, before, len(seeds))
    check = check_rooms(h.reports, num_layers=h.spec.num_layers, num_kv_heads=h.spec.num_kv_heads)
    assert len(rooms) == len(seeds), f"decode reported {len(rooms)} of {len(seeds)} rooms"
    assert rooms <= check.verified, {r: check.mismatched.get(r) for r in rooms}


def decode_counter(h: Hosts, name: str) -> float:
    return sum(c[name] for (role, _), c in read_counters(h.reports).items() if role == "decode")


def failures(h: Hosts, tag: str) -> dict[str, str]:
    """Decode's failed rooms of requests whose id holds `tag`: request id -> the reason decode logged."""
    lines = (h.logs / f"{h.decode.instance}.log").read_text(errors="replace").splitlines()
    return {m[2]: m[3] for line in lines if (m := _FAILED.search(line)) and tag in m[2]}


def run_through_cut(
    h: Hosts, cut: Callable[[], None], heal: Callable[[], None], hold_s: float
) -> tuple[str, dict[str, str]]:
    """Four requests through the router; `cut()` once their transfers are under way, `heal()` `hold_s` later.
    Every request must end with the single-instance tokens (vLLM recomputes what did not arrive) within its room's
    deadline plus a recompute. Returns the requests' id tag and decode's failures among them."""
    seeds = [1000 + next(_ids) for _ in range(4)]
    prompts = [prompt(s) for s in seeds]
    want = reference(h, prompts)
    tag = f"cut{seeds[0]}"
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, h.router, p, f"{tag}-{i}") for i, p in enumerate(prompts)]
        time.sleep(0.5)
        cut()
        time.sleep(hold_s)
        heal()
        got = [f.result() for f in futures]
    assert got == want, "a request cut off mid-transfer did not end with the single-instance tokens"
    assert time.monotonic() - started < ROOM_TIMEOUT_S + hold_s + 60.0, "a room outlived its deadline"
    found = failures(h, tag)
    assert all(reason.strip() for reason in found.values()), found
    return tag, found


def resumes(h: Hosts, timeout_s: float) -> None:
    """Requests through the router until decode reports a handed-off room: after a cut that dropped packets
    silently, TCP's retransmission backoff and `dead_after_s` may cost the first rooms after the heal."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = decode_rooms(h.reports)
        complete(h.router, prompt(4000 + next(_ids), 256))
        if wait_new_rooms(h, before, 1, timeout_s=5.0):
            return
        assert time.monotonic() < deadline, f"no room handed off within {timeout_s:.0f} s of the heal"


def assert_healed(h: Hosts, resume_s: float = 0.0) -> None:
    """After a heal (and `resume_s` for the first handoff): both instances hand off new rooms bit-exact, decode's
    ring drains (space of failed rooms stays quarantined a while: each new room's outcome writes the counters
    again), no canary byte was touched."""
    if resume_s:
        resumes(h, resume_s)
    assert_verified(h, [2000 + next(_ids), 2000 + next(_ids)])
    deadline = time.monotonic() + 2 * ROOM_TIMEOUT_S
    while decode_counter(h, "kvstage_ring_live_bytes") and time.monotonic() < deadline:
        time.sleep(2.0)
        complete(h.router, prompt(3000 + next(_ids), 256))
    assert decode_counter(h, "kvstage_ring_live_bytes") == 0, "ring space outlived its rooms"
    assert decode_counter(h, "kvstage_ring_canary_violations_total") == 0, "a write landed in released ring space"
    for proc in h.procs.values():
        assert proc.alive()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mooncake_across_hosts_hands_off_every_request_bit_exact_with_the_single_instance_tokens(hosts: Hosts) -> None:
    assert_verified(hosts, list(range(8)), tokens=320)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_link_cut_shorter_than_dead_after_ends_every_room_and_service_resumes_after_the_heal(hosts: Hosts) -> None:
    h = hosts
    run_through_cut(h, lambda: h.net.link_down("A", "B"), lambda: h.net.link_up("A", "B"), SHORT_CUT_S)
    assert_healed(h)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_link_cut_longer_than_dead_after_fails_rooms_with_named_reasons_and_vllm_recomputes(hosts: Hosts) -> None:
    h = hosts
    _, found = run_through_cut(h, lambda: h.net.link_down("A", "B"), lambda: h.net.link_up("A", "B"), LONG_CUT_S)
    assert found, "the cut hit no room: no transfer was under way"
    assert_healed(h)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_one_way_cut_from_prefill_to_decode_ends_every_room_and_service_resumes(hosts: Hosts) -> None:
    h = hosts
    run_through_cut(h, lambda: h.net.block("A", "B"), lambda: h.net.unblock("A"), LONG_CUT_S)
    assert_healed(h, resume_s=120.0)


def _hog(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("backend", "prefill_tp", "decode_tp"),
    [("nixl", 2, 1), ("nixl", 1, 2), ("mooncake", 1, 2)],
    ids=["nixl-2to1", "nixl-1to2", "mooncake-1to2"],
)
def test_the_three_host_demo_verifies_8_of_8(backend: str, prefill_tp: int, decode_tp: int, tmp_path: Path) -> None:
    options = DemoOptions(prefill_tp, decode_tp, 8, backend, hosts=3, work_dir=tmp_path)
    report = run_demo(options, quiet=True)
    assert report.verified == 8, report.problems
    assert report.ok, report.problems


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nixl_beside_a_cpu_hog_declares_no_live_peer_dead(tmp_path: Path) -> None:
    hogs = [multiprocessing.Process(target=_hog, args=(600.0,), daemon=True) for _ in range(4)]
    for hog in hogs:
        hog.start()
    try:
        report = run_demo(DemoOptions(2, 1, 8, "nixl", hosts=3, work_dir=tmp_path), quiet=True)
    finally:
        for hog in hogs:
            hog.kill()
    lines = [line for log in (tmp_path / "logs").glob("*.log") for line in log.read_text().splitlines()]
    dead = [line for line in lines if "peer dead" in line]
    assert not dead, dead[:5]
    assert report.ok, report.problems
