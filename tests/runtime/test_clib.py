"""runtime/clib.py: the one C library, built from the parts the packages declare (clib.toml),
found without naming a package, cached by the hash of every input."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.clib import Library, Part, find_parts, open_library
from runtime.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def test_every_c_file_of_the_tree_is_in_one_part():
    """No source or header is left out of the library's build and hash (nor in two parts)."""
    parts = find_parts()
    assert {p.folder.relative_to(REPO).as_posix() for p in parts} >= {
        "runtime/residency/core", "runtime/engine/hook", "runtime/native", "runtime/ramtier"}
    sources = [s for p in parts for s in p.sources]
    headers = [h for p in parts for h in (*p.headers, *p.private)]
    assert len(sources) == len(set(sources)) and len(headers) == len(set(headers))
    tree = REPO / "runtime"
    assert set(sources) == set(tree.rglob("*.c"))
    assert set(headers) == set(tree.rglob("*.h"))
    core = next(p for p in parts if p.folder.name == "core")
    assert [h.name for h in core.headers] == ["residency_core.h"]


def _part(folder: Path, manifest: str, files: dict[str, str]) -> Part:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "clib.toml").write_text(manifest)
    return Part.read(folder / "clib.toml")


GENERATOR = '''
def generate(folder):
    n = len(sorted(folder.glob("extra_*.c")))
    return '#include "base_impl.h"\\nint gen_count(void) { return BASE + %d; }\\n' % n
'''


def _parts(tmp_path: Path) -> tuple[Part, ...]:
    base = _part(tmp_path / "base", 'sources = ["*.c"]\nheaders = ["base.h"]\n'
                 'private = ["*.h"]\n[generated]\n"table.c" = "gen.py"\n', {
                     "base.h": "int base_twice(int x);\nint gen_count(void);\n",
                     "base_impl.h": "#define BASE 40\n",
                     "base.c": '#include "base.h"\nint base_twice(int x) { return 2 * x; }\n',
                     "extra_one.c": "int extra_one(void) { return 1; }\n",
                     "gen.py": GENERATOR})
    user = _part(tmp_path / "user", 'sources = ["user.c"]\nheaders = ["user.h"]\n', {
        "user.h": "int user_calls_base(int x);\n",
        "user.c": '#include "../base/base.h"\n'
                  "int user_calls_base(int x) { return base_twice(x) + 1; }\n"})
    return base, user


def test_parts_build_one_library_with_a_generated_source(tmp_path, monkeypatch):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    parts = _parts(tmp_path)
    library = Library.of(parts)
    lib, _ = open_library(library)
    assert lib.user_calls_base(20) == 41          # one part calls another's symbol
    assert lib.gen_count() == 41                  # the generated unit, with its part's header
    assert library.path().parent == tmp_path / "cache" / "clib"
    assert list(library.path().parent.iterdir()) == [library.path()]   # no temp file left

    # a new input is a new library: a file the generator sees changes the generated text
    (tmp_path / "base" / "extra_two.c").write_text("int extra_two(void) { return 2; }\n")
    again = Library.of(tuple(Part.read(p.folder / "clib.toml") for p in parts))
    assert again.path() != library.path()
    assert open_library(again)[0].gen_count() == 42
    # the same inputs are the same library
    assert Library.of(tuple(Part.read(p.folder / "clib.toml") for p in parts)).path() == \
        again.path()


def test_a_bad_manifest_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match=r"clib.toml: sources: no file matches 'missing\.c'"):
        _part(tmp_path / "a", 'sources = ["missing.c"]\n', {})
    with pytest.raises(UserError, match=r"unknown keys \['source'\]"):
        _part(tmp_path / "b", 'source = ["x.c"]\n', {"x.c": ""})
    with pytest.raises(UserError, match="generated: no script gen.py"):
        _part(tmp_path / "c", '[generated]\n"t.c" = "gen.py"\n', {})


def test_a_compile_error_is_one_line(tmp_path, monkeypatch):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    part = _part(tmp_path / "bad", 'sources = ["bad.c"]\n', {"bad.c": "int f(void) { return }\n"})
    with pytest.raises(UserError) as err:
        open_library(Library.of((part,)))
    message = str(err.value)
    assert message.startswith("moe-offload's C library could not be compiled: ")
    assert "\n" not in message and "error" in message
    assert not any((tmp_path / "cache" / "clib").iterdir())
