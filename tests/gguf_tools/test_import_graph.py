"""gguf_tools' modules import each other without a circle, and synth_spec loads without gguf-py.

An import inside a function counts as an arrow (it runs on a call); imports under
``if TYPE_CHECKING:`` do not (they never run).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gguf_tools

PACKAGE = Path(gguf_tools.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _imports(node: ast.AST) -> set[str]:
    """Dotted names that ``node`` imports, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
            found |= set().union(*map(_imports, child.orelse))
            continue
        if isinstance(child, ast.Import):
            found |= {a.name for a in child.names}
        elif isinstance(child, ast.ImportFrom) and child.module:
            found |= {child.module} | {f"{child.module}.{a.name}" for a in child.names}
        found |= _imports(child)
    return found


def _graph() -> dict[str, set[str]]:
    """gguf_tools module -> the gguf_tools modules it imports."""
    graph = {}
    for module in MODULES:
        names = _imports(ast.parse((PACKAGE / f"{module}.py").read_text()))
        graph[module] = {n.split(".")[1] for n in names if n.startswith("gguf_tools.")
                         and n.split(".")[1] in MODULES} - {module}
    return graph


def test_no_import_circle() -> None:
    graph = _graph()
    assert graph["synth_spec"] and graph["synth"]   # the parser sees the imports at all

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    circles = sorted(m for m in MODULES if m in reach(m))
    assert not circles, f"modules on an import circle: {circles} (graph: {graph})"


def test_synth_spec_imports_without_gguf() -> None:
    # the CLI describes and parses `moe-offload synth` without loading gguf-py
    code = "import sys, gguf_tools.synth_spec; assert 'gguf' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
