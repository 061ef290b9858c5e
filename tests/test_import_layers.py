"""Every module imports only downward: the layers of the tree, from the table below, read from
every import statement of every module (function-level imports included: they hide arrows
as well as any), and no import circle between the files of a package."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (layer, the units in it): a unit may import units of lower layers and itself, nothing else.
# A unit is a package (its subpackages included) or a top-level module.
LAYERS: list[tuple[str, ...]] = [
    ("runtime.errors",),                         # (and the bare `runtime` package, empty)
    ("runtime.units", "runtime.version", "runtime.atomic_write",
     "runtime.device_names"),                    # parses `rpc:HOST:PORT[/N]` device names
    ("gguf_tools",),                             # GGUF reading, writing, model facts
    ("runtime.cache", "runtime.traces"),
    ("runtime.clib",),                           # builds the one C library from the parts
                                                 # the packages declare (their clib.toml)
    ("runtime.residency",),                      # the manager, its core and policies
    ("runtime.native", "runtime.ramtier", "runtime.replay"),
    ("runtime.rpc",),
    ("runtime.engine.hook",),                    # the routing hook: C, its Python side and
                                                 # its slow reference (no engine import)
    ("runtime.engine",),                         # llama.cpp under residency
    ("runtime.planner",),                        # budgets from free memory: reads the
                                                 # engine's settings and probes rpc devices
    ("runtime.bench", "runtime.server"),
    ("runtime.commands",),                       # the CLI's commands and their shared flags
    ("runtime.cli",),
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units} | {"runtime": 0}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str | None:
    """The table's unit holding ``module`` (the longest matching prefix), None outside."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return None


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``; ``from P import name`` counts as
    ``P.name`` (a submodule, when it is one)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _sources() -> list[Path]:
    return sorted(p for top in ("runtime", "gguf_tools") for p in (REPO / top).rglob("*.py"))


def test_every_unit_of_the_tree_is_in_the_table():
    units = {unit_of(_module_name(p)) for p in _sources()}
    assert None not in units, [str(p) for p in _sources() if unit_of(_module_name(p)) is None]


def test_imports_go_down_the_layers():
    upward = []
    for path in _sources():
        here = unit_of(_module_name(path))
        for line, target in imported_modules(path):
            there = unit_of(target)
            if there is None or there == here:
                continue
            if RANK[there] >= RANK[here]:
                upward.append(f"{path.relative_to(REPO)}:{line}: {here} -> {there}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_circle_between_files():
    """Among the files of the tree (module level and function level alike)."""
    modules = {_module_name(p): p for p in _sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for _, target in imported_modules(path):
            while target and target not in modules:      # `from pkg import name` -> pkg
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)                         # a package's own __init__ aside
        graph[name] = deps
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_the_check_sees_an_upward_import():
    """The reader finds function-level and relative imports (the check can fail)."""
    source = REPO / "runtime" / "residency" / "_probe_for_test.py"
    source.write_text("def f():\n    from runtime.engine import engine\n"
                      "    from ..server import app\n")
    try:
        found = imported_modules(source)
    finally:
        source.unlink()
    assert sorted(unit_of(m) for _, m in found) == ["runtime.engine", "runtime.server"]
    assert all(RANK[unit_of(m)] > RANK["runtime.residency"] for _, m in found)
