"""kvstage's layers import downwards only, and the deterministic core imports nothing that does I/O.

Reads every module under src/kvstage with `ast` (nothing is imported), resolves each `import` and `from ... import`
(relative ones too, and those inside functions or under TYPE_CHECKING) to a top-level part of kvstage, and fails
naming the file and line of each import that points up, or sideways between two parts of one layer.
docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvstage"

#: Top to bottom. A part may import itself and any part of a lower layer; parts of one layer are independent.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("bench", "demo", "router"),
    ("e2e",),
    ("integrations",),
    ("runtime", "sim"),
    ("transport",),
    ("dataplane",),
    ("protocol",),
    ("layout", "ring"),
    ("errors",),
)
LEVEL = {part: len(LAYERS) - depth for depth, layer in enumerate(LAYERS) for part in layer}

#: The deterministic core never does I/O, sleeps, reads the clock, starts threads or draws random numbers.
CORE = ("protocol", "layout", "ring", "errors")
CORE_FORBIDDEN = frozenset(
    {"time", "random", "secrets", "socket", "threading", "asyncio", "os", "subprocess", "zmq", "torch", "numpy"}
)


def _part(path: Path, src: Path) -> str:
    """Top-level part of kvstage that `path` belongs to: 'protocol' for protocol/decode.py, 'ring' for ring.py."""
    relative = path.relative_to(src)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in `path`; `from x import y` gives x.y as well as x."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = list(path.relative_to(src.parent).parts[:-1])  # ['kvstage', 'protocol'] (also for __init__)
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def _target(name: str) -> str | None:
    """The part of kvstage a dotted import names, or None if it is not kvstage's (or is the root package)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "kvstage" and len(parts) > 1 and not parts[1].startswith("__") else None


def layering_violations(src: Path = SRC) -> list[str]:
    """Every import in `src` that points up or sideways, and every part missing from LAYERS."""
    problems: list[str] = []
    for path in sorted(src.rglob("*.py")):
        if path == src / "__init__.py":
            continue
        part = _part(path, src)
        if part not in LEVEL:
            problems.append(f"{path.relative_to(src.parent)}: part {part!r} has no layer; add it to LAYERS")
            continue
        seen: set[tuple[int, str]] = set()
        for line, name in _imports(path, src):
            target = _target(name)
            if target is None or target == part or (line, target) in seen:
                continue  # not kvstage, this part itself, or already named for this line
            seen.add((line, target))
            if LEVEL.get(target, LEVEL[part]) >= LEVEL[part]:
                problems.append(f"{path.relative_to(src.parent)}:{line}: {part} imports {name} ({target} is not below)")
    return problems


def core_io_imports(src: Path = SRC) -> list[str]:
    """Every import of an I/O, clock, thread or randomness module in the deterministic core."""
    problems = []
    for path in sorted(src.rglob("*.py")):
        if path != src / "__init__.py" and _part(path, src) in CORE:
            for line, name in _imports(path, src):
                if name.split(".")[0] in CORE_FORBIDDEN:
                    problems.append(f"{path.relative_to(src.parent)}:{line}: the core imports {name}")
    return problems


def test_every_import_points_down_a_layer() -> None:
    assert layering_violations() == []


def test_the_deterministic_core_imports_nothing_that_does_io() -> None:
    assert core_io_imports() == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("protocol/x.py", "from kvstage.runtime import agent\n", "protocol imports kvstage.runtime"),
        ("layout.py", "import kvstage.ring\n", "layout imports kvstage.ring"),
        ("sim/x.py", "from kvstage.runtime.agent import Agent\n", "sim imports kvstage.runtime"),
        ("dataplane/x.py", "def f():\n    from ..transport import control\n", "dataplane imports kvstage.transport"),
        ("newpart/x.py", "import json\n", "part 'newpart' has no layer"),
    ],
)
def test_an_upward_or_sideways_import_is_named(tmp_path: Path, module: str, source: str, expected: str) -> None:
    src = tmp_path / "kvstage"
    (src / module).parent.mkdir(parents=True, exist_ok=True)
    (src / module).write_text(source)
    (src / "errors.py").write_text("from kvstage import __version__\n")
    problems = layering_violations(src)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_downward_import_passes(tmp_path: Path) -> None:
    src = tmp_path / "kvstage"
    (src / "runtime").mkdir(parents=True)
    (src / "runtime" / "x.py").write_text("from kvstage.protocol.decode import DecodeEndpoint\nfrom . import y\n")
    assert layering_violations(src) == []


def test_a_clock_read_in_the_core_is_named(tmp_path: Path) -> None:
    src = tmp_path / "kvstage"
    (src / "protocol").mkdir(parents=True)
    (src / "protocol" / "x.py").write_text("import time\n")
    assert core_io_imports(src) == ["kvstage/protocol/x.py:1: the core imports time"]
