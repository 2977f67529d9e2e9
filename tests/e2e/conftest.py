"""A small cluster of real vLLM servers (CPU build, the tiny local model) with the kvstage connector, shared by
the end-to-end tests of this folder: a bootstrap service, prefill instances P2 (TP=2) and P1 (TP=1), decode
instances D1 (TP=1) and D2 (TP=2), and one kvstage router per (prefill, decode) pair under test.

Servers start once per session, together (about 2-4 min on 2 cores); the tests that kill an instance run last
(their module sorts them so) and take only the instances they kill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvstage.e2e.model import TinyModelSpec, build_tiny_model
from kvstage.e2e.servers import ManagedProcess, VLLMServerSpec, free_port, start_bootstrap, start_router, start_vllm

#: Rooms of the test servers end within this many seconds. A rank silent for DEAD_AFTER_S is dead, sooner than
#: the room deadline: a killed prefill is fenced, and the ring space its rooms held is released, before they time out.
ROOM_TIMEOUT_S = 30.0
DEAD_AFTER_S = 10.0


@dataclass
class Cluster:
    model: Path
    bootstrap: ManagedProcess
    specs: dict[str, VLLMServerSpec]
    procs: dict[str, ManagedProcess]
    reports: Path
    logs: Path
    routers: dict[tuple[str, str], ManagedProcess]

    def url(self, name: str) -> str:
        return self.specs[name].url

    def router(self, prefill: str, decode: str) -> str:
        """The URL of a router for this pair, started on first use."""
        key = (prefill, decode)
        if key not in self.routers:
            log = self.logs / f"router-{prefill}-{decode}.log"
            proc = start_router(self.bootstrap.url, [self.specs[prefill]], [self.specs[decode]], log)
            proc.wait_ready(60.0)
            self.routers[key] = proc
        return self.routers[key].url

    def reset_prefix_cache(self, name: str) -> None:
        httpx.post(f"{self.url(name)}/reset_prefix_cache", timeout=30.0).raise_for_status()


@pytest.fixture(scope="session")
def spec() -> TinyModelSpec:
    return TinyModelSpec()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, spec: TinyModelSpec) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(spec, root / "cache")
    reports, logs = root / "reports", root / "logs"
    bootstrap = start_bootstrap(logs)
    bootstrap.wait_ready(60.0)
    extra = (("room_timeout_s", ROOM_TIMEOUT_S), ("dead_after_s", DEAD_AFTER_S))
    layout = {"P2": ("prefill", 2), "P1": ("prefill", 1), "D1": ("decode", 1), "D2": ("decode", 2)}
    specs = {
        name: VLLMServerSpec(
            role,
            name,
            tp,
            free_port(),
            model,
            bootstrap.url,
            report_dir=str(reports),
            dev_mode=True,
            extra_config=extra,
        )
        for name, (role, tp) in layout.items()
    }
    procs = {name: start_vllm(s, logs) for name, s in specs.items()}
    cluster = Cluster(model, bootstrap, specs, procs, reports, logs, {})
    try:
        for proc in procs.values():
            proc.wait_ready(600.0)
        yield cluster
    finally:
        for proc in [*cluster.routers.values(), *procs.values(), bootstrap]:
            proc.stop()
