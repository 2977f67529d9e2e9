"""A small cluster of real vLLM servers (CPU build, the tiny local model) with the kvstage connector, shared by
the end-to-end tests of this folder: a bootstrap service, prefill instances P2 (TP=2) and P1 (TP=1), decode
instances D1 (TP=1) and D2 (TP=2), and one kvstage router per set of instances under test.

Servers start once per session, together, without torch.compile (`enforce_eager`: the six took 300 s to start
with it on 2 cores, 138 s without); so does PS, a prefill instance (TP=1) with a tiny KV cache, when a collected
test asks for it (the `small_prefill` fixture), and so does D32, a decode instance (TP=1) of 32-token blocks
against the others' 128 (the `small_blocks` fixture). MP2 and MD1, an MLA pair (prefill
TP=2, decode TP=1) serving the tiny DeepSeek-V2 model, start once the cluster is up, when a test asks for them
(`mla_pair`): started with it, seven servers on 2 cores missed the 600 s start bound. A test may add a server of
its own (`Cluster.start`), which lives until the session ends or a test kills it. The tests that kill an instance
(or may leave one dead) are named `test_z...`: they run after every other test of this folder, in the order of
their names, whatever module they are in, and take only the instances they kill. The folder itself runs after the
rest of the session, so that the servers stop once its tests are done (`pytest_collection_modifyitems` below).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstage.e2e.model import MODELS, TinyModelSpec, build_tiny_model
from kvstage.e2e.servers import (
    ManagedProcess,
    VLLMServerSpec,
    free_port,
    start_bootstrap,
    start_router,
    start_vllm,
    vllm_stacks,
)

#: Rooms of the test servers end within this many seconds. A rank silent for DEAD_AFTER_S is dead, sooner than
#: the room deadline: a killed prefill is fenced, and the ring space its rooms held is released, before they time out.
#: Prefill waits as long for a silent decode rank (not the connector's 4 s): vLLM's CPU workers on this 2-core host
#: were seen silent for seconds (docs/deploy.md), and a decode rank declared dead costs a recompute, which would
#: fail these tests' bit-exact checks; tests/runtime/test_decode_death.py checks the 4 s default.
ROOM_TIMEOUT_S = 30.0
DEAD_AFTER_S = 10.0
EXTRA_CONFIG: tuple[tuple[str, object], ...] = (
    ("room_timeout_s", ROOM_TIMEOUT_S),
    ("dead_after_s", DEAD_AFTER_S),
    ("decode_dead_after_s", DEAD_AFTER_S),
)

#: A prefill instance (TP=1) with a tiny KV cache, for the tests that need prefill to preempt: 9 usable blocks of
#: 128 tokens, 128 tokens per step and at most 32 of them per request, so that concurrent prompts of a few blocks
#: each are computed side by side and run out of blocks. Only sessions with a test that uses the `small_prefill`
#: fixture start it, with the other servers.
SMALL_PREFILL = "PS"
SMALL_PREFILL_SPEC: dict[str, Any] = {
    "max_model_len": 1024,
    "extra_args": (
        *("--num-gpu-blocks-override", "10"),
        *("--max-num-batched-tokens", "128"),
        *("--long-prefill-token-threshold", "32"),
    ),
}

#: Instances whose vLLM block size (32) differs from the cluster's (vLLM CPU's default, 128; it takes multiples of
#: 32), both TP=1: D32, which sessions with a test that uses the `small_blocks` fixture start with the other
#: servers, and P32, which the slow test of the reverse direction starts on its own (`Cluster.start`).
BLOCKS_OF_32: dict[str, Any] = {"extra_args": ("--block-size", "32")}
SMALL_BLOCKS: dict[str, tuple[str, int, dict[str, Any]]] = {"D32": ("decode", 1, BLOCKS_OF_32)}
SMALL_BLOCKS_PREFILL: tuple[str, str, int, dict[str, Any]] = ("P32", "prefill", 1, BLOCKS_OF_32)

#: The MLA pair (tiny DeepSeek-V2, vLLM's CPU MLA backend): prefill TP=2 and decode TP=1, reporting into a folder
#: of their own (their rooms carry one latent head).
MLA_PAIR = {"MP2": ("prefill", 2), "MD1": ("decode", 1)}

#: The cluster's servers are ready within this, or the session fails.
START_TIMEOUT_S = 600.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failed end-to-end test reports where each vLLM process of the machine stands (py-spy's Python stacks of
    every process named VLLM::..., its engine core and workers): an engine that hangs is then diagnosable from the
    test's output alone, after its servers are gone. (A cluster fixture that fails stops its servers before this
    runs, so those say it themselves: test_hosts.py's warm-up.)"""
    report = yield
    if report.when == "call" and report.failed:
        report.sections.append(("vLLM stacks at the failure", vllm_stacks()))
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests run after every other test of the session: the cluster's servers live until the session
    ends, and idle they still poll (each vLLM worker wakes every 0.2 ms, KVSTAGE_VLLM_NO_SPIN), which took CPU from
    the rest of the suite when they started halfway through it. Its `test_z...` tests (they kill instances of the
    shared cluster) run after its other tests, of every module, and in the order of their names. The first test
    that uses the cluster starts it: its time limit (pytest-timeout, 300 s a test in pyproject.toml) grows by the
    cluster's own bound."""
    here = Path(__file__).parent
    ours = {id(item) for item in items if here in item.path.parents}
    rest = [item for item in items if id(item) not in ours]
    folder = [item for item in items if id(item) in ours]
    last = sorted((item for item in folder if item.name.startswith("test_z")), key=lambda item: item.name)
    others = [item for item in folder if not item.name.startswith("test_z")]
    items[:] = [*rest, *others, *last]
    first = next((item for item in items if "cluster" in getattr(item, "fixturenames", ())), None)
    if first is not None:
        first.add_marker(pytest.mark.timeout(300 + START_TIMEOUT_S))


@dataclass
class Cluster:
    model: Path
    bootstrap: ManagedProcess
    specs: dict[str, VLLMServerSpec]
    procs: dict[str, ManagedProcess]
    reports: Path
    logs: Path
    routers: dict[tuple[str, ...], ManagedProcess]

    def url(self, name: str) -> str:
        return self.specs[name].url

    def router(self, prefill: str, *decodes: str, extra_args: Sequence[str] = ()) -> str:
        """The URL of a router in front of `prefill` and `decodes` (used in turn), with more router flags
        `extra_args`, started on first use."""
        key = (prefill, *decodes, *extra_args)
        if key not in self.routers:
            log = self.logs / f"router-{'-'.join((prefill, *decodes))}-{len(self.routers)}.log"
            proc = start_router(
                self.bootstrap.url, [self.specs[prefill]], [self.specs[d] for d in decodes], log, extra_args
            )
            proc.wait_ready(60.0)
            self.routers[key] = proc
        return self.routers[key].url

    def spec_for(self, name: str, role: str, tp: int, **fields: Any) -> VLLMServerSpec:
        """A server of the cluster's kind (its model, bootstrap, reports and room timing), on a free port, with
        `VLLMServerSpec` fields changed by `fields`."""
        values: dict[str, Any] = {
            "model": self.model,
            "report_dir": str(self.reports),
            "dev_mode": True,
            "extra_config": EXTRA_CONFIG,
            "enforce_eager": True,
        }
        values.update(fields)
        return VLLMServerSpec(role, name, tp, free_port(), bootstrap=self.bootstrap.url, **values)

    def mla_spec(self, name: str, role: str, tp: int) -> VLLMServerSpec:
        """A server of the tiny DeepSeek-V2 (MLA) model, reporting into `mla_reports`."""
        model = build_tiny_model(MODELS["deepseek-tiny"], self.model.parent.parent)
        return self.spec_for(name, role, tp, model=model, report_dir=str(self.mla_reports))

    @property
    def mla_reports(self) -> Path:
        return self.reports / "mla"

    def start(self, name: str, role: str, tp: int, **fields: Any) -> None:
        """Start one more server (`spec_for`) and wait until it serves. It stops with the cluster."""
        self.specs[name] = self.spec_for(name, role, tp, **fields)
        self.procs[name] = start_vllm(self.specs[name], self.logs)
        self.procs[name].wait_ready(600.0)

    def kill(self, name: str) -> None:
        """kill -9 of a server (its workers too), unless it is gone already."""
        self.procs[name].kill()

    def reset_prefix_cache(self, name: str) -> None:
        httpx.post(f"{self.url(name)}/reset_prefix_cache", timeout=30.0).raise_for_status()

    def assert_serving(self, *names: str) -> None:
        """Each server is alive and its /health answers 200; else fail with the tail of its log."""
        for name in names:
            try:
                status: object = httpx.get(f"{self.url(name)}/health", timeout=10.0).status_code
            except httpx.HTTPError as exc:
                status = repr(exc)
            if status != 200 or not self.procs[name].alive():
                raise AssertionError(
                    f"{name} does not serve (/health: {status}); its log ends:\n{self.procs[name].log_tail()}"
                )


@pytest.fixture(scope="session")
def spec() -> TinyModelSpec:
    return TinyModelSpec()


@pytest.fixture(scope="session")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, spec: TinyModelSpec
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(spec, root / "cache")
    reports, logs = root / "reports", root / "logs"
    bootstrap = start_bootstrap(logs)
    bootstrap.wait_ready(60.0)
    cluster = Cluster(model, bootstrap, {}, {}, reports, logs, {})
    layout: dict[str, tuple[str, int, dict[str, Any]]] = {
        "P2": ("prefill", 2, {}),
        "P1": ("prefill", 1, {}),
        "D1": ("decode", 1, {}),
        "D2": ("decode", 2, {}),
    }
    if _asked_for(request, "small_prefill"):
        layout[SMALL_PREFILL] = ("prefill", 1, SMALL_PREFILL_SPEC)  # it starts with the others, not on its own
    if _asked_for(request, "small_blocks"):
        layout.update(SMALL_BLOCKS)
    for name, (role, tp, fields) in layout.items():
        cluster.specs[name] = cluster.spec_for(name, role, tp, **fields)
    for name, spec in cluster.specs.items():
        cluster.procs[name] = start_vllm(spec, logs)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc in cluster.procs.values():
            proc.wait_ready(max(deadline - time.monotonic(), 1.0))
        yield cluster
    finally:
        for proc in [*cluster.routers.values(), *cluster.procs.values(), bootstrap]:
            proc.stop()


def _asked_for(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test of the session that will run (not skipped: slow ones without --run-slow) uses `fixture`."""
    return any(
        fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker("skip") is None
        for item in request.session.items
    )


@pytest.fixture(scope="session")
def mla_pair(cluster: Cluster) -> tuple[str, str]:
    """The MLA pair's (prefill, decode) names (MLA_PAIR), started after the cluster when a test first asks."""
    for name, (role, tp) in MLA_PAIR.items():
        if name not in cluster.specs:
            cluster.specs[name] = cluster.mla_spec(name, role, tp)
            cluster.procs[name] = start_vllm(cluster.specs[name], cluster.logs)
    for name in MLA_PAIR:
        cluster.procs[name].wait_ready(START_TIMEOUT_S)
    return "MP2", "MD1"


@pytest.fixture(scope="session")
def small_blocks(cluster: Cluster) -> tuple[str, ...]:
    """The decode instance of 32-token blocks (SMALL_BLOCKS), started with the cluster when a collected test asks
    for it."""
    for name, (role, tp, fields) in SMALL_BLOCKS.items():
        if name not in cluster.specs:
            cluster.start(name, role, tp, **fields)
    return tuple(SMALL_BLOCKS)


@pytest.fixture(scope="session")
def small_prefill(cluster: Cluster) -> str:
    """The small prefill instance (SMALL_PREFILL), started with the cluster when a collected test asks for it."""
    if SMALL_PREFILL not in cluster.specs:
        cluster.start(SMALL_PREFILL, "prefill", 1, **SMALL_PREFILL_SPEC)
    return SMALL_PREFILL
