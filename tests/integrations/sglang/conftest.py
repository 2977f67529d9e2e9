"""Tests of kvstage's sglang backend: they import sglang 0.5.23 on a CPU host, as sglang's own CPU tests do.

sglang imports its CUDA kernel package (`sgl_kernel`) and torchvision at import time; neither works beside a CPU
torch, so both are stubbed before sglang is imported (sglang's `maybe_stub_sgl_kernel` does the same for its
kernels). Nothing of kvstage's is stubbed. Without sglang 0.5.23 installed (`make sglang`) every test here skips.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from unittest.mock import MagicMock

import pytest

STUBBED = ("sgl_kernel", "torchvision")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__getattr__ = lambda name: MagicMock()  # type: ignore[method-assign]


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == s or fullname.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def _sglang_ready() -> bool:
    from kvstage.integrations.sglang.version import SGLANG_VERSION, installed_sglang_version

    return installed_sglang_version() == SGLANG_VERSION and importlib.util.find_spec("triton") is not None


SGLANG = _sglang_ready()
if SGLANG and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="sglang 0.5.23 is not installed (make sglang)")
    for item in items:
        if "integrations/sglang" in str(item.fspath):
            item.add_marker(pytest.mark.sglang)
            if not SGLANG:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A config-only model directory for sglang's `ModelConfig`, once sglang's plugins are loaded (as every sglang
    process does: it registers the kvstage backend) and a gloo world of one is up."""
    from sglang.srt.plugins import load_plugins
    from sglang_queues_harness import init_world, write_model

    load_plugins()
    init_world()
    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def queues_of(model: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """Makes `sglang_queues_harness.Cluster`s (prefill TP, decode TP, room timeout, ...); closes them after."""
    from sglang_queues_harness import Cluster

    made: list[Cluster] = []

    def make(p_tp: int, d_tp: int, timeout_s: float = 20, **kwargs: Any) -> Cluster:
        made.append(Cluster(model, p_tp, d_tp, monkeypatch, timeout_s, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()
