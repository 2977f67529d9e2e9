"""`kvstage bootstrap` and `kvstage router` as real processes: loopback by default, open binds refused without a
secret, a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import peer_record
from kvstage.errors import TransportError
from kvstage.transport.bootstrap import BootstrapClient, BootstrapServer

KVSTAGE = [sys.executable, "-c", "from kvstage.cli import main; main()"]


def _env(**extra: str) -> dict[str, str]:
    unset = ("KVSTAGE_SECRET", "KVSTAGE_API_KEY", "KVSTAGE_UPSTREAM_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(extra)
    return env


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTAGE, *args], capture_output=True, text=True, timeout=60, env=_env(**env))


class _Service:
    """A `kvstage` service process whose stderr (its log) is read line by line."""

    def __init__(self, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [*KVSTAGE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(**env)
        )
        self.log: list[str] = []

    def wait_for_line(self, pattern: str) -> re.Match[str]:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            found = re.search(pattern, line)
            if found:
                return found
        raise AssertionError(f"exited ({self.proc.wait()}) without logging {pattern!r}:\n{''.join(self.log)}")

    def stop(self, signum: int) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def services() -> Iterator[list[_Service]]:
    started: list[_Service] = []
    yield started
    for service in started:
        service.kill()


@pytest.mark.parametrize("command", [["bootstrap"], ["router", "--bootstrap", "tcp://127.0.0.1:7100"]])
def test_open_bind_without_a_secret_is_refused_naming_the_secret(command: list[str]) -> None:
    extra = (
        ["--prefill", "P0=http://127.0.0.1:1", "--decode", "D0=http://127.0.0.1:2"] if command[0] == "router" else []
    )
    done = _run(*command, *extra, "--host", "0.0.0.0")
    assert done.returncode != 0
    message = " ".join(done.stderr.split())
    assert "KVSTAGE_SECRET" in message and "--secret-file" in message and "--insecure" in message


def test_bootstrap_on_loopback_serves_until_sigterm(services: list[_Service]) -> None:
    service = _Service("bootstrap", "--port", "0")
    services.append(service)
    address = service.wait_for_line(r"bootstrap listening on (tcp://127\.0\.0\.1:\d+)").group(1)
    client = BootstrapClient(address)
    client.register(peer_record("P0", "prefill", 2, 1))
    assert [r.rank for r in client.lookup_instance("P0", "prefill")] == [1]
    client.close()
    assert service.stop(signal.SIGTERM) == 0


def test_bootstrap_open_bind_with_a_secret_serves_only_under_it(services: list[_Service], tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-shared-secret-of-32-characters\n")
    with_file = _Service("bootstrap", "--host", "0.0.0.0", "--port", "0", "--secret-file", str(secret))
    services.append(with_file)
    port = with_file.wait_for_line(r"bootstrap listening on tcp://0\.0\.0\.0:(\d+)").group(1)
    trusted = BootstrapClient(f"tcp://127.0.0.1:{port}", secret=b"a-shared-secret-of-32-characters")
    trusted.register(peer_record("P0", "prefill", 2, 0))
    assert len(trusted.lookup_instance("P0", "prefill")) == 1
    trusted.close()
    stranger = BootstrapClient(f"tcp://127.0.0.1:{port}", timeout_s=2.0)
    with pytest.raises(TransportError, match="shared secret"):
        stranger.lookup_instance("P0", "prefill")
    stranger.close()
    assert with_file.stop(signal.SIGINT) == 0


def test_bootstrap_open_bind_under_insecure_starts_with_a_warning(services: list[_Service]) -> None:
    insecure = _Service("bootstrap", "--host", "0.0.0.0", "--port", "0", "--insecure")
    services.append(insecure)
    insecure.wait_for_line(r"WARNING .*without a secret \(--insecure\)")
    insecure.wait_for_line(r"bootstrap listening on")
    assert insecure.stop(signal.SIGTERM) == 0


def test_a_secret_shorter_than_16_bytes_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("s3cret")
    refused = _run("bootstrap", "--secret-file", str(short))
    assert refused.returncode == 2 and "at least 16" in refused.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_router_help_lists_the_resilience_and_key_flags() -> None:
    done = _run("router", "--help", COLUMNS="200")
    assert done.returncode == 0
    for flag in (
        "--max-attempts",
        "--probe-interval",
        "--health-timeout",
        "--breaker-failures",
        "--breaker-cooldown",
        "--bootstrap-timeout",
        "--api-key",
        "--upstream-api-key",
        "KVSTAGE_API_KEY",
        "KVSTAGE_UPSTREAM_API_KEY",
        "--discover",
        "--policy",
        "--block-tokens",
        "--prefix-balance",
    ):
        assert flag in done.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [(("--prefill", "P=http://h:1"), "--discover"), (("--discover", "--policy", "fastest"), "--policy")],
    ids=["no decode and no discovery", "unknown policy"],
)
def test_a_router_with_nothing_to_route_to_or_an_unknown_policy_is_refused_naming_the_flag(
    args: tuple[str, ...], named: str
) -> None:
    refused = _run("router", "--bootstrap", "tcp://127.0.0.1:1", *args)
    assert refused.returncode == 2 and named in refused.stderr


def test_router_command_serves_health_and_stops_on_sigterm(
    services: list[_Service], bootstrap: BootstrapServer
) -> None:
    port = _free_port()
    args = ["router", "--bootstrap", bootstrap.address, "--port", str(port)]
    upstreams = ["--prefill", "P0=http://127.0.0.1:1", "--decode", "D0=http://127.0.0.1:2"]
    service = _Service(*args, *upstreams, KVSTAGE_API_KEY="the-client-key")
    services.append(service)
    service.wait_for_line(rf"Uvicorn running on http://127\.0\.0\.1:{port}")
    reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert reply.status_code == 503  # registered, but nobody listens at either URL
    states = {i["name"]: i for i in reply.json()["instances"]}
    assert states["P0"]["tp_size"] == 2 and states["D0"]["reason"].startswith("connect")
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401  # the key from the env
    service.proc.send_signal(signal.SIGTERM)
    service.wait_for_line("router stopped")
    assert service.proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it stopped on
