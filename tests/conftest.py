"""Suite-wide options and services: long soak runs are opt-in (`--run-slow`), so `make test` stays within its budget;
`EtcdServer` and its fixture `etcd` run a real etcd server (Debian's `etcd-server`, which `make test` installs) on
free loopback ports with its data in a temp dir, for the tests of the directory on etcd."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow (soak runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="soak run: pass --run-slow to include it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """One real etcd member on loopback; `stop` and `start` again keep its data (and so its records and leases)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def address(self, namespace: str = "kvstage", lease_s: int | None = None) -> str:
        query = "" if lease_s is None else f"?lease_s={lease_s}"
        return f"etcd://127.0.0.1:{self.client_port}/{namespace}{query}"

    def start(self) -> EtcdServer:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        argv = ["etcd", "--name", "kvstage-test", "--data-dir", str(self.data_dir), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvstage-test={peer}"]  # fmt: skip
        log = (self.data_dir.parent / "etcd.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{(self.data_dir.parent / 'etcd.log').read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def _answers(self) -> bool:
        try:
            return httpx.post(f"http://127.0.0.1:{self.client_port}/v3/kv/range", json={"key": "AA=="}).is_success
        except httpx.TransportError:
            return False


def _etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A fresh etcd server for one test, which may stop and start it."""
    yield from _etcd(tmp_path_factory)


@pytest.fixture(scope="module")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """An etcd server for the tests of one module that leave it running (each under a namespace of its own)."""
    yield from _etcd(tmp_path_factory)
