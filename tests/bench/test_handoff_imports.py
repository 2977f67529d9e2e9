"""The handoff scenario's contract with the runtime: bench/handoff.py imports only the public API that both the
current runtime and its rewrite keep, and bench/handoff_stats.py imports no kvstage at all, so that
benchmarks/handoff_ab.py can run these two files against another git ref's `kvstage`."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "src" / "kvstage" / "bench"
#: kvstage module -> the names bench/handoff.py may import from it (None: the module itself)
ALLOWED: dict[str, set[str] | None] = {
    "kvstage": None,
    "kvstage.bench.config": {"BenchConfig"},
    "kvstage.bench.handoff_stats": None,
    "kvstage.dataplane": {"KVPool"},
    "kvstage.errors": {"ConfigError", "KVStageError"},
    "kvstage.layout": {"heads_of_rank"},
    "kvstage.protocol": {"Timing"},
    "kvstage.runtime": {"AgentConfig", "DecodeAgent", "PrefillAgent", "peer_id"},
    "kvstage.transport.bootstrap": {"BootstrapServer"},
    "kvstage.transport.data": {"TransportConfig"},
}


def _kvstage_imports(path: Path) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "kvstage"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvstage":
            out += [(node.module or "", alias.name) for alias in node.names]
    return out


def test_handoff_imports_only_the_runtime_api_both_runtimes_keep() -> None:
    imports = _kvstage_imports(BENCH / "handoff.py")
    assert imports, "the scenario must import the runtime"
    for module, name in imports:
        assert module in ALLOWED, f"bench/handoff.py imports {module}, outside the API both runtimes keep"
        names = ALLOWED[module]
        assert names is None or name in names, f"bench/handoff.py imports {name} from {module}"


def test_handoff_stats_imports_no_kvstage() -> None:
    assert _kvstage_imports(BENCH / "handoff_stats.py") == []
