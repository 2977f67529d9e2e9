"""kvstage's layers import downwards only, its modules import each other in no circle, no source file is over
MAX_LINES lines, and the deterministic core imports nothing that does I/O.

Reads every module under src/kvstage with `ast` (nothing is imported) and resolves each `import` and
`from ... import` (relative ones too, and those inside functions or under TYPE_CHECKING). Layers: each import is
resolved to a top-level part of kvstage, and the check fails naming the file and line of each import that points
up, or sideways between two parts of one layer. Circles: each import is resolved to the module it loads
(`from kvstage.sim import world` loads kvstage.sim.world; `from kvstage.protocol import Codec` loads the package's
__init__, so a module taking its own package's re-exports depends on that __init__), and the check fails naming
every group of modules that import each other, with the lines that close the circle.
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


def _statements(path: Path, src: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute dotted name, names taken from it) of every import in `path`: `import x.y` gives ('x.y', ()),
    `from x import a, b` gives ('x', ('a', 'b'))."""
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = list(path.relative_to(src.parent).parts[:-1])  # ['kvstage', 'protocol'] (also for __init__)
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((node.lineno, base, tuple(alias.name for alias in node.names)))
    return found


def _imports(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in `path`; `from x import y` gives x.y as well as x."""
    return [
        (line, name)
        for line, base, names in _statements(path, src)
        for name in (base, *(f"{base}.{alias}" for alias in names))
    ]


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


def _module(path: Path, src: Path) -> str:
    """Dotted name of the module `path` holds: kvstage.sim.world for sim/world.py, kvstage.sim for sim/__init__.py."""
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """Each module of `src` -> the modules of `src` it loads, with the line of the first import of each."""
    modules = {_module(path, src): path for path in sorted(src.rglob("*.py"))}

    def loaded(name: str) -> str | None:  # the module itself, else the module or package that defines the name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph[module] = {}
        for line, base, names in sorted(_statements(path, src)):
            # `from x import y` loads x.y when that is a module, else x (which defines y); `import x` loads x
            wanted = [f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names] or [base]
            for target in map(loaded, wanted):
                if target is not None and target != module:
                    edges.setdefault(target, line)
    return graph


def import_cycles(src: Path = SRC) -> list[str]:
    """Every group of modules of `src` that import each other (a strongly connected component of the import
    graph), each named with the imports inside the group."""
    graph = import_graph(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm; the graph has a hundred nodes, recursion is fine
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    problems = []
    for group in sorted(groups):
        inside = [f"{m}:{line} imports {t}" for m in group for t, line in sorted(graph[m].items()) if t in group]
        problems.append(f"{len(group)} modules import each other: " + "; ".join(inside))
    return problems


#: No source file is longer than this (a longer one is split where it divides).
MAX_LINES = 600


def long_files(src: Path = SRC, limit: int = MAX_LINES) -> list[str]:
    """Every source file of `src` over `limit` lines."""
    lengths = {path: len(path.read_text().splitlines()) for path in sorted(src.rglob("*.py"))}
    return [f"{path.relative_to(src.parent)}: {n} lines, over {limit}" for path, n in lengths.items() if n > limit]


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


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert import_cycles() == []


def test_no_source_file_is_over_the_line_limit() -> None:
    assert long_files() == []


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


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "kvstage"
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # two modules, one import under TYPE_CHECKING and one inside a function
            {
                "sim/__init__.py": "",
                "sim/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstage.sim.b import B\n",
                "sim/b.py": "def f():\n    from .a import A\n",
            },
            "2 modules import each other: kvstage.sim.a:3 imports kvstage.sim.b; kvstage.sim.b:2 imports kvstage.sim.a",
        ),
        (  # a module that takes its own package's re-exports depends on the package's __init__
            {"sim/__init__.py": "from kvstage.sim.world import World\n", "sim/world.py": "from kvstage.sim import X\n"},
            "2 modules import each other: kvstage.sim:1 imports kvstage.sim.world; "
            "kvstage.sim.world:1 imports kvstage.sim",
        ),
        (  # three modules around, through the root package
            {"__init__.py": "from kvstage.a import x\n", "a.py": "import kvstage.b\n", "b.py": "from . import y\n"},
            "3 modules import each other: kvstage:1 imports kvstage.a; kvstage.a:1 imports kvstage.b; "
            "kvstage.b:1 imports kvstage",
        ),
    ],
)
def test_a_circle_of_imports_is_named(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    problems = import_cycles(_tree(tmp_path, files))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_importing_a_sibling_module_through_the_package_is_no_circle(tmp_path: Path) -> None:
    files = {
        "sim/__init__.py": "from kvstage.sim.world import World\n",
        "sim/world.py": "from kvstage.sim import clock\nfrom kvstage.sim.clock import Clock\n",
        "sim/clock.py": "import json\n",
    }
    assert import_cycles(_tree(tmp_path, files)) == []


def test_a_file_over_the_line_limit_is_named(tmp_path: Path) -> None:
    src = _tree(tmp_path, {"short.py": "x = 1\n" * 3, "long.py": "x = 1\n" * 4})
    assert long_files(src, limit=3) == ["kvstage/long.py: 4 lines, over 3"]
