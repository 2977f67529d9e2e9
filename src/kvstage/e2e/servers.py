"""Processes of an end-to-end run: vLLM servers with the kvstage connector, and the kvstage router.

Owns `Placement` (where a process runs: the address it binds, the command prefix that puts it on its host, the
deployment's secret), `VLLMServerSpec` (one vLLM OpenAI server: its role, instance name, TP size, port, placement
and kvstage settings), `ManagedProcess` (a child process in its own process group, with its log file, readiness
probe, graceful stop and kill -9 of the whole group), and the functions that start each kind: vLLM,
`kvstage bootstrap` and `kvstage router`, each in a process of its own as a deployment runs them; and
`vllm_stacks`, where every vLLM process of the machine stands and how long its main thread waited to run (for a
run that fails or hangs). Nothing here knows about requests.

Invariants: every process started here is in its own session, so stopping or killing it takes its workers with
it; a process that exits before it is ready raises at once with the tail of its log; `stop` always reaps.
Called by the vLLM demo (kvstage.demo.vllm) and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstage.errors import KVStageError, TransportError
from kvstage.transport.bootstrap import BootstrapClient

#: Tokens a request may span (prompt + completion) on the tiny model's servers.
MAX_MODEL_LEN = 2048
#: py-spy's answer per process is cut to this many characters by `vllm_stacks`.
STACKS_CHARS = 6000


class ProcessFailed(KVStageError):
    """A managed process exited, or never became ready."""


def child_pythonpath() -> str:
    """`PYTHONPATH` for a child: the folder this kvstage was imported from first, so that the servers run the same
    kvstage as their parent (a worktree's `src`, say, rather than the checkout the venv installed)."""
    root = str(Path(__file__).resolve().parents[2])  # .../src of .../src/kvstage/e2e/servers.py
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_ready(url: str) -> Callable[[], bool]:
    """Readiness of an HTTP service: its /health answers 200."""

    def probe() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False  # not listening yet

    return probe


def bootstrap_ready(address: str, secret: str = "") -> Callable[[], bool]:
    """Readiness of a bootstrap service: it answers a lookup (made under `secret`, if any)."""

    def probe() -> bool:
        client = BootstrapClient(address, timeout_s=2.0, secret=secret.encode() or None)
        try:
            client.lookup([])
        except TransportError:
            return False
        finally:
            client.close()
        return True

    return probe


@dataclass
class ManagedProcess:
    """A child process in its own process group, logging to `log_path`, ready when `ready()` says so.
    `url` is where it serves (an HTTP URL, or the bootstrap's tcp:// address)."""

    name: str
    argv: list[str]
    log_path: Path
    url: str
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": child_pythonpath(), **self.env},
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ProcessFailed(f"{self.name} exited before it was ready; its log ends:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        raise ProcessFailed(f"{self.name} was not ready within {timeout_s:.0f} s; its log ends:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9 of the whole process group (a crash, as the failure tests want it)."""
        self._signal(signal.SIGKILL)
        self._reap(10.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL of the group after `timeout_s`."""
        self._signal(signal.SIGTERM)
        if not self._reap(timeout_s):
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.proc.pid, sig)

    def _reap(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        # The group may outlive its leader (vLLM's workers): make sure none is left.
        self._signal(signal.SIGKILL)
        return True


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a process runs: the address it binds and is reached at, the command prefix that starts it on its
    host (`ip netns exec NS` for a host of `kvstage.e2e.hosts`; nothing for this one), and the deployment's shared
    secret (`KVSTAGE_SECRET`; needed by every process once anything binds beyond loopback)."""

    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    secret: str = ""
    extra_env: tuple[tuple[str, str], ...] = ()

    def env(self) -> dict[str, str]:
        return {**({"KVSTAGE_SECRET": self.secret} if self.secret else {}), **dict(self.extra_env)}

    def argv(self, argv: Sequence[str]) -> list[str]:
        return [*self.prefix, *argv]

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"


#: This host, on the loopback address, without a secret.
LOCAL = Placement()


@dataclass(frozen=True, slots=True)
class VLLMServerSpec:
    """One vLLM server with the kvstage connector. `role` is "prefill" or "decode"."""

    role: str
    instance: str
    tp: int
    port: int
    model: Path
    bootstrap: str
    backend: str = "local"
    report_dir: str = ""
    kv_cache_gib: int = 1
    dev_mode: bool = False  # vLLM's development endpoints, e.g. POST /reset_prefix_cache
    extra_config: tuple[tuple[str, object], ...] = ()
    max_model_len: int = MAX_MODEL_LEN
    extra_args: tuple[str, ...] = ()  # more vLLM flags, e.g. ("--num-gpu-blocks-override", "12")
    #: vLLM's --enforce-eager: no torch.compile of the model at start (on a loaded 2-core host, compiling took 1-2
    #: minutes per server; the tests' tiny model runs as fast without it)
    enforce_eager: bool = False
    placement: Placement = LOCAL
    extra_env: tuple[tuple[str, str], ...] = ()  # more environment, e.g. UCX's settings

    @property
    def url(self) -> str:
        return self.placement.url(self.port)

    def kv_transfer_config(self) -> dict[str, object]:
        extra: dict[str, object] = {
            "instance": self.instance,
            "bootstrap": self.bootstrap,
            "backend": self.backend,
            "url": self.url,  # published with the ranks' records: `kvstage router --discover` finds the server
        }
        if self.placement.address != LOCAL.address:
            extra["host"] = self.placement.address
        if self.report_dir:
            extra["report_dir"] = self.report_dir
        extra.update(dict(self.extra_config))
        return {
            "kv_connector": "KVStageConnector",
            "kv_connector_module_path": "kvstage.integrations.vllm",
            "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def argv(self) -> list[str]:
        return self.placement.argv(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(self.model),
                "--served-model-name",
                "tiny",
                "--host",
                self.placement.address,
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--max-model-len",
                str(self.max_model_len),
                "--tensor-parallel-size",
                str(self.tp),
                "--kv-transfer-config",
                json.dumps(self.kv_transfer_config()),
                "--middleware",  # requests from sglang-router carry their room in fields only it sends
                f"kvstage.integrations.vllm.sglang_router.{self.role.capitalize()}BehindSGLangRouter",
                *(("--enforce-eager",) if self.enforce_eager else ()),
                *self.extra_args,
            ]
        )

    def env(self) -> dict[str, str]:
        """vLLM on CPU: a small KV cache, one OpenMP thread per process, and no worker bound to a core
        (`VLLM_CPU_OMP_THREADS_BIND=nobind`). Bound, each TP rank's threads could run on one core only, and on
        the shared 2-core host a rank was seen waiting 107 s to run on its core (its schedstat run delay) while
        other processes' threads ran there and its peer rank spun in vLLM's shared-memory all-reduce: the
        engine hung (docs/deploy.md). Unbound, the kernel moves a waiting worker to the other core."""
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "KVSTAGE_VLLM_NO_SPIN": "1",
            "KVSTAGE_BOOTSTRAP": self.bootstrap,  # where decode's middleware finds sglang-router's prefill
            **self.placement.env(),
            **dict(self.extra_env),
        }
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env


def start_vllm(spec: VLLMServerSpec, log_dir: Path) -> ManagedProcess:
    name = f"{spec.role} {spec.instance} (TP={spec.tp})"
    log = log_dir / f"{spec.instance}.log"
    return ManagedProcess(name, spec.argv(), log, spec.url, http_ready(spec.url), spec.env()).start()


def start_bootstrap(log_dir: Path, placement: Placement = LOCAL) -> ManagedProcess:
    """`kvstage bootstrap` on a free port of `placement`, in its own process (as a deployment runs it)."""
    port = free_port()
    address = f"tcp://{placement.address}:{port}"
    argv = placement.argv(
        [sys.executable, "-m", "kvstage", "bootstrap", "--host", placement.address, "--port", str(port)]
    )
    ready = bootstrap_ready(address, placement.secret)
    log = log_dir / "bootstrap.log"
    return ManagedProcess("bootstrap", argv, log, address, ready, placement.env()).start()


def start_router(
    bootstrap: str,
    prefill: list[VLLMServerSpec],
    decode: list[VLLMServerSpec],
    log_path: Path,
    extra_args: Sequence[str] = (),
    placement: Placement = LOCAL,
) -> ManagedProcess:
    """`kvstage router` on a free port of `placement`, in front of the given instances (each role's in turn),
    with `extra_args` (more router flags) appended."""
    port = free_port()
    url = placement.url(port)
    argv = [sys.executable, "-m", "kvstage", "router", "--bootstrap", bootstrap]
    argv += ["--host", placement.address, "--port", str(port)]
    for spec in [*prefill, *decode]:
        argv += [f"--{spec.role}", f"{spec.instance}={spec.url}"]
    argv += extra_args
    return ManagedProcess("router", placement.argv(argv), log_path, url, http_ready(url), placement.env()).start()


def vllm_stacks() -> str:
    """py-spy's Python stacks of every process of this machine named VLLM::... (engine cores and workers), each cut
    to `STACKS_CHARS`, then a line per process on where its main thread stands with the scheduler (last, so that
    the tail of a test's output shows it): where a hung engine stands, readable after its servers are gone."""
    found = subprocess.run(["pgrep", "^VLLM::"], capture_output=True, text=True, check=False).stdout.split()
    if not found:
        return "no VLLM:: process runs"
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    dumps = [_py_spy(spy, pid) for pid in found] if spy is not None else ["py-spy is not installed"]
    return "\n".join([*dumps, "main threads and the scheduler:", *(main_thread_scheduling(pid) for pid in found)])


def _py_spy(spy: str, pid: str) -> str:
    try:
        out = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return f"py-spy gave no answer for process {pid} within 30 s"
    return (out.stdout + out.stderr)[:STACKS_CHARS]


def main_thread_scheduling(pid: str) -> str:
    """Process `pid`'s main thread (Linux): its state, the CPUs it may run on, and how long it has run and waited
    on a run queue since it started (schedstat). A thread that waited far longer than it ran was starved of CPU."""
    proc = Path("/proc") / pid
    try:
        name = (proc / "comm").read_text().strip()
        state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        cpus = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(int(pid))))
        ran_ns, waited_ns = (int(x) for x in (proc / "schedstat").read_text().split()[:2])
    except (OSError, ValueError) as exc:
        return f"{pid}: not readable ({exc})"
    return f"{pid} {name}: state {state}, CPUs {cpus}, ran {ran_ns / 1e9:.1f} s, waited to run {waited_ns / 1e9:.1f} s"
