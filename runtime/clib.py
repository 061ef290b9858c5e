"""Build and load moe-offload's one C library from the parts its packages declare.

A package with C code declares its part in a ``clib.toml`` beside its sources (paths relative
to that folder; globs allowed, their matches sorted; every entry must match a file):

    sources = ["*.c"]                   # compiled into the library
    headers = ["residency_core.h"]      # public: the library's cdef (cffi), in this order
    private = ["*.h"]                   # included by sources only (a public one stays public)
    [generated]                         # optional: sources written at build time
    "policy_table.c" = "policy_table.py"

A generated source is the text ``generate(folder)`` returns, ``generate`` a function of the
named script of the same folder, which is run by path (not imported: a part's generator must
not need the packages above this module); it compiles with its part's folder on the include
path. The parts are found by a glob over the tree (``runtime/**/clib.toml``, sorted by
folder): this module names no package, so it sits low in the layers and the packages above
it declare what they add (the residency core; the routing hook, which calls the core, the
device cache's mechanism and the RAM tier's per-layer work directly).

ONE library, whatever the parts: the routing hook calls the core and the tiers by symbol,
and a second copy of the core would have its own tables (two handles to "one" core, pointer
comparisons between them wrong). Compiled on first use (``$CC``, else ``cc``; plain C, no
Python headers) into the cache's ``clib/`` folder, named by a hash of every input (the
manifests, sources, headers, generated texts, compiler and flags), and opened with cffi in
ABI mode. A machine without a compiler gets one clear line (``UserError``).

    lib, ffi = load_library()
"""
from __future__ import annotations

import hashlib
import os
import re
import runpy
import shlex
import shutil
import subprocess
import tempfile
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path

from cffi import FFI

from runtime.cache import cache_dir
from runtime.errors import UserError

TREE = Path(__file__).resolve().parent          # runtime/: where the parts are found
MANIFEST = "clib.toml"
# -ffp-contract=off: no fused multiply-add where a target has one (aarch64 fuses a + b * c by
# default), so the core's doubles stay its Python reference's
FLAGS = ("-O2", "-ffp-contract=off", "-shared", "-fPIC")
LIBS = ("-lm", "-lpthread")
_KEYS = {"sources", "headers", "private", "generated"}


@dataclass(frozen=True)
class Part:
    """One package's part of the library, as its ``clib.toml`` declares it."""

    folder: Path
    manifest: bytes                       # the file's bytes (part of the library's hash)
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]             # public: the cdef
    private: tuple[Path, ...]             # included by the sources only
    generated: tuple[tuple[str, Path], ...] = ()   # (file name, generator script)

    @classmethod
    def read(cls, manifest: Path) -> Part:
        """The part ``manifest`` declares; UserError on an unknown key or a missing file."""
        raw = manifest.read_bytes()
        try:
            spec = tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{manifest}: {exc}") from None
        if set(spec) - _KEYS:
            raise UserError(f"{manifest}: unknown keys {sorted(set(spec) - _KEYS)} "
                            f"(a part has {', '.join(sorted(_KEYS))})")
        folder = manifest.parent

        def files(key: str) -> tuple[Path, ...]:
            found: list[Path] = []
            for pattern in spec.get(key, ()):
                matches = sorted(folder.glob(pattern))
                if not matches:
                    raise UserError(f"{manifest}: {key}: no file matches {pattern!r}")
                found += [m for m in matches if m not in found]
            return tuple(found)

        headers = files("headers")
        generated = tuple((name, folder / script)
                          for name, script in spec.get("generated", {}).items())
        for _, script in generated:
            if not script.is_file():
                raise UserError(f"{manifest}: generated: no script {script.name}")
        return cls(folder, raw, files("sources"), headers,
                   tuple(p for p in files("private") if p not in headers), generated)

    def generated_texts(self) -> tuple[tuple[str, str], ...]:
        """(file name, text) of each generated source, as its script writes it now."""
        return tuple((name, runpy.run_path(str(script))["generate"](self.folder))
                     for name, script in self.generated)


def find_parts(tree: Path = TREE) -> tuple[Part, ...]:
    """Every part declared under ``tree``, in folder order."""
    return tuple(Part.read(m) for m in sorted(tree.rglob(MANIFEST), key=lambda m: m.parent))


@dataclass(frozen=True)
class Library:
    """The one library made of ``parts`` (its inputs read once: the hash is over them)."""

    parts: tuple[Part, ...]
    generated: tuple[tuple[tuple[str, str], ...], ...]   # per part: ((file name, text), ...)

    @classmethod
    def of(cls, parts: tuple[Part, ...]) -> Library:
        return cls(parts, tuple(part.generated_texts() for part in parts))

    def path(self) -> Path:
        """Where this library is (or will be) in the cache: named by the hash of its inputs."""
        digest = hashlib.sha256()
        for part, generated in zip(self.parts, self.generated):
            digest.update(part.manifest)
            for p in (*part.sources, *part.headers, *part.private):
                name = p.relative_to(part.folder).as_posix()
                digest.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
            for name, text in generated:
                digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        digest.update(" ".join((os.environ.get("CC", ""), *FLAGS)).encode())  # another CC
        return cache_dir("clib") / f"libmoe_offload-{digest.hexdigest()[:16]}.so"

    def cdef(self) -> str:
        """The public headers' declarations (comments and preprocessor lines dropped)."""
        text = "\n".join(re.sub(r"/\*.*?\*/", "", h.read_text(), flags=re.S)
                         for part in self.parts for h in part.headers)
        return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))

    def compile(self, target: Path) -> None:
        """Compile every part into ``target`` (written whole or not at all)."""
        cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")
                                                       or ""]
        if not cc[0]:
            raise UserError("moe-offload's C library needs a C compiler: install one (e.g. "
                            "`apt-get install gcc`) or set CC")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            args = [str(p) for part in self.parts for p in part.sources]
            for i, (part, generated) in enumerate(zip(self.parts, self.generated)):
                for name, text in generated:
                    src = Path(work) / f"{i}-{name}"
                    src.write_text(text)
                    args += ["-iquote", str(part.folder), str(src)]
            tmp = Path(work) / target.name
            try:
                done = subprocess.run([*cc, *FLAGS, "-o", str(tmp), *args, *LIBS],
                                      capture_output=True, text=True, timeout=180)
            except OSError as exc:
                raise UserError(f"moe-offload's C library could not be compiled ({cc[0]}: "
                                f"{exc.strerror})") from None
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["?"]
                last = next((ln for ln in lines if "error" in ln), lines[-1]).strip()
                raise UserError(f"moe-offload's C library could not be compiled: {last}")
            os.replace(tmp, target)


def open_library(library: Library) -> tuple:
    """(lib, ffi) of ``library``, compiled first if the cache lacks it."""
    path = library.path()
    if not path.is_file():
        library.compile(path)
    ffi = FFI()
    ffi.cdef(library.cdef())
    return ffi.dlopen(str(path)), ffi


_lock = threading.Lock()
_loaded: tuple | None = None


def load_library() -> tuple:
    """(lib, ffi) of the tree's one C library (found, built once per input version, opened
    once per process)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = open_library(Library.of(find_parts()))
        return _loaded


def library_path() -> Path:
    """Where the tree's library is in the cache (built or not)."""
    return Library.of(find_parts()).path()
