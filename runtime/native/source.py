"""The llama.cpp source a native build starts from, and the fingerprints that key the cache.

Source: the llama.cpp that llama-cpp-python 0.3.36 vendors (``vendor/llama.cpp`` of its sdist,
upstream commit 0c1e57098), from the repository's pruned archive (``ARCHIVE``: the library
parts and the Python bindings, ``scripts/make_source_archive.py``; no download), or from a path:
the sdist ``.tar.gz``, an unpacked sdist, a llama.cpp tree, or a pruned archive. Only the parts
a library build needs are extracted (see ``NEEDED``). ``download_sdist`` fetches the whole
sdist (pip, cached) for what the archive leaves out (llama-server's tests).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from runtime.cache import cache_dir
from runtime.errors import UserError

SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
# the source every build starts from unless told otherwise (in the repository: offline)
ARCHIVE = Path(__file__).resolve().parents[2] / "offline" / \
    "llama-cpp-python-0.3.36-pruned.tar.xz"
SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
VENDOR_PREFIX = "vendor/llama.cpp/"

# what the libraries (libllama, libggml*, libmtmd) need from a llama.cpp tree; ggml/src holds
# every backend, whose unused ones are dropped from the pruned archive
# (scripts/make_source_archive.py); tools/mtmd is libmtmd (images through an mmproj)
NEEDED = ("CMakeLists.txt", "cmake/", "ggml/", "include/", "src/", "vendor/", "LICENSE",
          "tools/mtmd/")
# left out even when present: large and never compiled for the libraries (mtmd's sample
# media, tests, CLIs and conversion scripts included)
SKIPPED = ("vendor/cpp-httplib/", "tools/mtmd/test-", "tools/mtmd/tests/",
           "tools/mtmd/legacy-models/", "tools/mtmd/mtmd-cli.cpp", "ggml/src/ggml-webgpu/", "ggml/src/ggml-sycl/", "ggml/src/ggml-cann/",
           "ggml/src/ggml-musa/", "ggml/src/ggml-opencl/", "ggml/src/ggml-zdnn/",
           "ggml/src/ggml-hexagon/", "ggml/src/ggml-zendnn/", "ggml/src/ggml-openvino/")


def cache_root() -> Path:
    """Where builds live: ``$MOE_OFFLOAD_NATIVE_DIR``, else the cache's ``native/`` folder."""
    env = os.environ.get("MOE_OFFLOAD_NATIVE_DIR")
    if env:
        return Path(env).expanduser()
    return cache_dir("native")


def _wanted(rel: str) -> bool:
    return rel.startswith(NEEDED) and not rel.startswith(SKIPPED)


def download_sdist(dest_dir: Path) -> Path:
    """The llama-cpp-python sdist, downloaded by pip once (then reused from ``dest_dir``)."""
    target = dest_dir / SDIST_NAME
    if target.is_file():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    # only llama-cpp-python as source: ":all:" would also build its build requirements from
    # source to prepare its metadata (minutes of compiling cmake/ninja on 2 cores)
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
           "-q", SDIST_REQUIREMENT, "-d", str(dest_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not target.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"pip download {SDIST_REQUIREMENT}: failed ({last})")
    return target


class Source:
    """A llama.cpp source: a tarball (sdist or pruned archive) or a directory."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_file():
            if not tarfile.is_tarfile(path):
                raise UserError(f"{path}: not a tar archive (expected the llama-cpp-python sdist "
                                "or a pruned llama.cpp archive)")
            self.kind = "tarball"
        elif path.is_dir():
            root = path / "vendor" / "llama.cpp" if (path / "vendor" / "llama.cpp").is_dir() else path
            if not (root / "src" / "llama-graph.cpp").is_file() or not (root / "ggml").is_dir():
                raise UserError(f"{path}: not a llama.cpp tree (no src/llama-graph.cpp, ggml/)")
            self.kind = "dir"
            self.root = root
        else:
            raise UserError(f"{path}: no such file or directory")

    def fingerprint(self) -> str:
        """sha256 of the tarball, or of the needed files of the tree (paths and contents)."""
        h = hashlib.sha256()
        if self.kind == "tarball":
            with open(self.path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            return h.hexdigest()
        for rel, full in sorted(self._tree_files()):
            h.update(rel.encode() + b"\0")
            h.update(full.read_bytes())
        return h.hexdigest()

    def _tree_files(self):
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in filenames:
                full = Path(dirpath) / name
                rel = full.relative_to(self.root).as_posix()
                if _wanted(rel) and not full.is_symlink():
                    yield rel, full

    def extract(self, dest: Path) -> None:
        """Copy the needed llama.cpp files to ``dest`` (which must not exist)."""
        dest.mkdir(parents=True)
        if self.kind == "dir":
            for rel, full in self._tree_files():
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(full, out)
            return
        with tarfile.open(self.path) as tar:
            for member in tar:
                name = member.name
                # an sdist holds llama_cpp_python-X/vendor/llama.cpp/...; a pruned archive llama.cpp/...
                idx = name.find(VENDOR_PREFIX)
                if idx >= 0:
                    rel = name[idx + len(VENDOR_PREFIX):]
                elif name.startswith("llama.cpp/"):
                    rel = name[len("llama.cpp/"):]
                else:
                    continue
                if not rel or not _wanted(rel) or not (member.isfile() or member.isdir()):
                    continue
                if ".." in Path(rel).parts:
                    raise UserError(f"{self.path}: unsafe path in archive: {name}")
                out = dest / rel
                if member.isdir():
                    out.mkdir(parents=True, exist_ok=True)
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.chmod(out, member.mode & 0o755 | 0o644)
        if not (dest / "src" / "llama-graph.cpp").is_file():
            raise UserError(f"{self.path}: the archive holds no llama.cpp source "
                            "(expected vendor/llama.cpp/ or llama.cpp/)")


def resolve_source(path: str | os.PathLike[str] | None) -> Source:
    """The given source, or the repository's archive when ``path`` is None."""
    if path is not None:
        return Source(Path(path).expanduser().resolve())
    if not ARCHIVE.is_file():
        raise UserError(f"{ARCHIVE}: missing (a checkout of the repository has it; or pass "
                        "--source PATH)")
    return Source(ARCHIVE)
