"""Every C file of the library calls only downward: the layers of its files, from the table
below, read from every call in every function body (a header's inline functions and macros
included; calls through a function pointer, a policy's or a consumer's, are the descriptor's
business and not read), no call circle between the modules (x.c with its x.h), and no file
includes another part's private header (runtime/clib.py: a part's clib.toml; a part without
sources, runtime/csupport/, is support for all). The C twin of test_import_layers.py."""
from __future__ import annotations

import graphlib
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

from runtime.clib import find_parts

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "runtime"

# (layer, the units in it), lowest first: a unit may call units of lower layers and itself,
# nothing else. A unit is a set of files (patterns relative to runtime/).
LAYERS: list[tuple[tuple[str, tuple[str, ...]], ...]] = [
    (("support", ("csupport/*",)),),                          # grow.h
    (("core models", ("residency/core/models/*",)),),        # the learned policies' models
    (("core records", ("residency/core/residency_core.h", "residency/core/core_impl.h")),),
    (("core orders", ("residency/core/order.c", "residency/core/order_heap.h")),),
    (("core policies", ("residency/core/policies/*.c",)),),   # one policy a file, none calls
    (("core holds", ("residency/core/leases.c",)),),          # another; its state its own
    (("core state", ("residency/core/state.c",)),),           # every key's state changes
    (("core prefetch", ("residency/core/prefetch.c",)),),
    (("core access", ("residency/core/residency_core.c",)),
     ("core lifetime", ("residency/core/lifetime.c",)),
     ("core verify", ("residency/core/verify.c",))),
    (("core api", ("residency/core/api.c",)),),               # the entry points (the mutex)
    (("core step", ("residency/core/step.c",)),),             # rc_step, rc_bench_live
    (("device cache", ("native/*",)), ("RAM tier", ("ramtier/*",))),
    (("hook framing", ("engine/hook/route_frame.h",)),),
    (("hook records", ("engine/hook/route_hook.h", "engine/hook/route_hook_impl.h")),),
    (("hook consumers", ("engine/hook/route_consumers.c",)),
     ("hook imposed routing", ("engine/hook/route_impose.c",))),
    (("hook", ("engine/hook/route_hook.c",)),),               # the callback
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit, _ in units}
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "case",
            "defined", "__attribute__", "_Static_assert", "__builtin_expect"}


def unit_of(path: Path) -> str | None:
    rel = path.relative_to(TREE).as_posix()
    found = [unit for units in LAYERS for unit, patterns in units
             if any(fnmatch(rel, p) for p in patterns)]
    assert len(found) <= 1, (rel, found)
    return found[0] if found else None


def _strip(text: str) -> str:
    """Comments, strings and character literals blanked (newlines kept: lines still count)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', blank,
                  text, flags=re.S)


class CFile:
    """One file's definitions (functions with a body, function-like macros) and, per
    definition, the names it calls."""

    def __init__(self, path: Path, text: str | None = None):
        self.path = path
        text = _strip(path.read_text() if text is None else text)
        self.includes = re.findall(r'^\s*#\s*include\s*"([^"]+)"', path.read_text(), re.M)
        self.static: set[str] = set()
        self.calls: list[tuple[int, str, str]] = []    # (line, caller, callee)
        self.defines: set[str] = set()
        code = []
        lines = text.split("\n")
        i = 0
        while i < len(lines):                          # macros: a definition of their own
            line = lines[i]
            if line.lstrip().startswith("#"):
                start = i
                body = line
                while body.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    body = body[:-1] + " " + lines[i]
                m = re.match(r"\s*#\s*define\s+(\w+)\(", body)
                if m:
                    self.defines.add(m.group(1))
                    self.static.add(m.group(1))
                    rest = body[m.end():]
                    for name in self._called(rest):
                        self.calls.append((start + 1, m.group(1), name))
                code += [""] * (i - start + 1)
            else:
                code.append(line)
            i += 1
        self._functions("\n".join(code))

    @staticmethod
    def _called(body: str) -> list[str]:
        return [m.group(1) for m in re.finditer(r"(?<![\w.>])([A-Za-z_]\w*)\s*\(", body)
                if m.group(1) not in KEYWORDS]

    def _functions(self, code: str) -> None:
        depth, last_end, current, start = 0, 0, None, 0
        for m in re.finditer(r"[{};]", code):
            ch = m.group(0)
            if depth == 0 and ch == "{":
                head = code[last_end:m.start()]
                d = re.match(r"\s*(?:[\w\s*]*?)\b(\w+)\s*\([^;{}]*\)\s*$", head, re.S)
                current = d.group(1) if d and d.group(1) not in KEYWORDS else None
                if current is not None:
                    self.defines.add(current)
                    if re.search(r"\bstatic\b", head):
                        self.static.add(current)
                start = m.end()
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    if current is not None:
                        line0 = code.count("\n", 0, start) + 1
                        body = code[start:m.start()]
                        for n in self._called(body):
                            at = body.find(n + "(")
                            line = line0 + body.count("\n", 0, max(at, 0))
                            self.calls.append((line, current, n))
                    current = None
                    last_end = m.end()
            elif depth == 0:
                last_end = m.end()


def c_files(tree: Path = TREE) -> list[Path]:
    return sorted(p for ext in ("*.c", "*.h") for p in tree.rglob(ext))


def call_graph(files: list[CFile]) -> list[tuple[CFile, int, str, CFile]]:
    """(caller file, line, callee name, callee file) of every call between two files: a name
    the calling file defines is its own; else the one file that defines it with external
    linkage, else the one header that defines it (inline or a macro); else outside
    (libc, llama.cpp)."""
    external: dict[str, list[CFile]] = {}
    in_header: dict[str, list[CFile]] = {}
    for f in files:
        for name in f.defines:
            if f.path.suffix == ".h":
                in_header.setdefault(name, []).append(f)
            elif name not in f.static:
                external.setdefault(name, []).append(f)
    edges = []
    for f in files:
        for line, _, name in f.calls:
            if name in f.defines:
                continue
            there = external.get(name) or in_header.get(name) or []
            assert len(there) <= 1, f"{name} is defined in {[str(t.path) for t in there]}"
            if there:
                edges.append((f, line, name, there[0]))
    return edges


@pytest.fixture(scope="module")
def parsed() -> list[CFile]:
    return [CFile(p) for p in c_files()]


def test_every_c_file_is_in_the_table(parsed):
    assert [str(f.path) for f in parsed if unit_of(f.path) is None] == []


def test_calls_go_down_the_layers(parsed):
    upward = []
    for f, line, name, g in call_graph(parsed):
        here, there = unit_of(f.path), unit_of(g.path)
        if here != there and RANK[there] >= RANK[here]:
            upward.append(f"{f.path.relative_to(REPO)}:{line}: {name} ({here} -> {there})")
    assert not upward, "calls against the layers:\n" + "\n".join(upward)


def module(path: Path) -> str:
    """A module: x.c and its header x.h (whose inline functions may call x.c's) are one."""
    return str(path.with_suffix(""))


def test_no_call_circle_between_modules(parsed):
    graph: dict[str, set[str]] = {module(f.path): set() for f in parsed}
    for f, _, _, g in call_graph(parsed):
        if module(g.path) != module(f.path):
            graph[module(f.path)].add(module(g.path))
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("call circle: " + " -> ".join(Path(p).relative_to(REPO).as_posix()
                                                  for p in exc.args[1]))


def test_only_the_policies_reach_their_models(parsed):
    """A learned policy's model (next-visit's, affinity's) is its own state: only the policy
    files call or include it; the mechanism (the core's other files) names none of them."""
    models = {f.path for f in parsed if unit_of(f.path) == "core models"}
    wrong = [f"{f.path.relative_to(REPO)}:{line}: {name}"
             for f, line, name, g in call_graph(parsed)
             if g.path in models and unit_of(f.path) not in ("core models", "core policies")]
    for f in parsed:
        if unit_of(f.path) in ("core models", "core policies"):
            continue
        wrong += [f"{f.path.relative_to(REPO)}: #include {inc}" for inc in f.includes
                  if (f.path.parent / inc).resolve() in models]
    assert not wrong, "the mechanism reaches a policy's model:\n" + "\n".join(wrong)


def test_no_part_includes_another_parts_private_header(parsed):
    """A private header is its part's (grow.h once was the core's and was included by the
    hook and the RAM tier); a part without sources (support) is included by any."""
    owner = {h: part for part in find_parts() if part.sources for h in part.private}
    wrong = []
    for f in parsed:
        for inc in f.includes:
            target = (f.path.parent / inc).resolve()
            part = owner.get(target)
            if part is not None and part.folder not in f.path.parents:
                wrong.append(f"{f.path.relative_to(REPO)}: {inc}")
    assert not wrong, "another part's private header:\n" + "\n".join(wrong)


def test_the_check_sees_calls_through_headers_and_macros(tmp_path):
    """The reader finds a call in a body, in an inline function of a header and in a macro,
    not one through a function pointer; a circle between two files is found (the checks can
    fail)."""
    a, b, h = tmp_path / "a.c", tmp_path / "b.c", tmp_path / "h.h"
    h.write_text("static inline int twice(int x) { return helper(x) * 2; }\n"
                 "#define CALL_B(x) \\\n    from_b(x)\n")
    a.write_text('#include "h.h"\n/* from_b( in a comment */\nint helper(int x) {\n'
                 '    return x;\n}\nstatic int local(int x) { return x; }\n'
                 "int from_a(int x, int (*fp)(int)) {\n    if (x) return CALL_B(x);\n"
                 '    const char *s = "from_b(";\n    return fp(x) + ops->step(x) + local(x);\n}\n')
    b.write_text('#include "h.h"\nint from_b(int x) { return x ? from_a(x, 0) : twice(x); }\n')
    files = [CFile(p) for p in (a, b, h)]
    edges = {(f.path.name, name, g.path.name) for f, _, name, g in call_graph(files)}
    assert edges == {("a.c", "CALL_B", "h.h"), ("h.h", "from_b", "b.c"), ("h.h", "helper", "a.c"),
                     ("b.c", "from_a", "a.c"), ("b.c", "twice", "h.h")}
    graph = {module(f.path): {module(g.path) for ff, _, _, g in call_graph(files) if ff is f}
             for f in files}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
