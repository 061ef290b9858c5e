"""Build the patched llama.cpp libraries and the device cache store into a content-keyed cache.

    info = build(BuildRequest(backend="cpu"))     # minutes the first time, instant afterwards
    print(info.lib_dir)                           # LLAMA_CPP_LIB_PATH for llama-cpp-python

Steps: resolve the source (runtime/native/source.py), key the build by sha256(source
fingerprint, patch series, the device cache store's sources, backend, CMake arguments), and if
that key is not built yet: extract the source to a fixed work directory (fixed, so ccache hits
across keys), apply ``llamacpp/patches/*.patch`` in order, configure and build the shared
libraries with CMake (apps, tools, tests, examples off; libmtmd on), compile the device cache
store (``llamacpp/device_cache/``, the device cache's slots and tables in llama.cpp:
STORE_SOURCES) against them, and copy the libraries (RUNPATH ``$ORIGIN``) to ``<cache>/<key>/lib``;
``build.json`` is written last, so a directory without it is not a build.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from runtime.errors import UserError
from runtime.native import vulkan_sdk
from runtime.native.source import cache_root, resolve_source

# 2: libmtmd built beside libllama (a build without it is not current)
BUILD_FORMAT = 2
BACKENDS = ("cpu", "cuda", "vulkan")
NATIVE_DIR = Path(__file__).resolve().parents[2] / "llamacpp"
# the device cache store: the device cache's slots and tables in llama.cpp (dc_store_*): its
# public header (the cdef of device_cache_store.py), its private one and its sources, every
# byte of them in the build key (patches_hash)
STORE_DIR = NATIVE_DIR / "device_cache"
STORE_HEADER = "device_cache_store.h"
STORE_SOURCES = (STORE_HEADER, "device_cache_store_impl.h", "device_cache_store.cpp",
                 "device_cache_slots.cpp", "device_cache_route.cpp")
STORE_LIB = "libmoe_device_cache.so"

_COMMON_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    # the sdist has no git metadata: app/ needs build-info.h
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # libmtmd alone (tools/mtmd: images and audio through an mmproj), none of the other tools;
    # no video (it spawns ffmpeg)
    "-DLLAMA_BUILD_MTMD=ON", "-DMTMD_VIDEO=OFF",
    # ggml-cpu's own threads, not OpenMP's: the engine attaches a thread pool that lives as long
    # as the context (llama_lib.Threadpools; without one ggml starts and joins its threads at
    # every graph, and the routing hook splits a decode into ~150), and patch 0008's barrier
    # spins briefly then sleeps. Measured at real scale on a 2-core VM (ceiling, t/s): OpenMP
    # with passive waits 8.0 at -t 2 against 9.1 at -t 1; this 12.2 against 8.8
    "-DGGML_OPENMP=OFF",
    # the libraries find each other next to themselves, wherever the cache is
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)


@dataclass(frozen=True)
class BuildRequest:
    """What to build. ``native_cpu``: -march=native for the CPU backend (this machine only)."""

    backend: str = "cpu"
    source: str | None = None        # None: the repository's archive (offline/)
    cuda_arch: str | None = None     # CMAKE_CUDA_ARCHITECTURES, e.g. "90"; None: "native"
    cuda_fa: bool = True             # the FlashAttention CUDA kernels (about half the compile time)
    native_cpu: bool = True
    jobs: int | None = None          # parallel compile jobs; None: CMAKE_BUILD_PARALLEL_LEVEL or cores
    rpc: bool = True                 # GGML_RPC=ON: ggml's RPC backend (libggml-rpc, remote devices)
    extra_cmake_args: tuple[str, ...] = ()   # the user's own (CMAKE_ARGS), after ours

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UserError(f"--backend {self.backend}: unknown (choose from {', '.join(BACKENDS)})")


@dataclass(frozen=True)
class BuildInfo:
    """One finished build, as recorded in its ``build.json``."""

    key: str
    backend: str
    lib_dir: str
    patches_hash: str
    source: str
    source_fingerprint: str
    cmake_args: tuple[str, ...]
    built_at: float          # unix time
    build_seconds: float
    rpc: bool = False        # libggml-rpc built (moe-offload rpc-server, rpc:HOST:PORT devices)

    def to_dict(self) -> dict:
        return asdict(self)


def patch_files() -> list[Path]:
    """The patch series, applied in file-name order."""
    return sorted((NATIVE_DIR / "patches").glob("*.patch"))


def patches_hash() -> str:
    """sha256 over the patch series and the store's sources: what makes a build current."""
    h = hashlib.sha256(f"format {BUILD_FORMAT}\n".encode())
    for p in patch_files() + [STORE_DIR / s for s in STORE_SOURCES]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_signature() -> str:
    """The CPU's feature flags: a -march=native build is only valid on a CPU like this one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return os.uname().machine


def cmake_args(req: BuildRequest) -> tuple[str, ...]:
    args = list(_COMMON_ARGS)
    args.append(f"-DGGML_NATIVE={'ON' if req.native_cpu else 'OFF'}")
    if req.backend == "cuda":
        # one GPU: no NCCL (a pip-installed one would be linked but not found at run time)
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={req.cuda_arch or 'native'}",
                 "-DGGML_CUDA_NCCL=OFF", f"-DGGML_CUDA_FA={'ON' if req.cuda_fa else 'OFF'}"]
    elif req.backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    if req.rpc:
        # TCP only: RDMA would link libibverbs where found, a dependency the remote may lack
        args += ["-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF"]
    return tuple(args) + tuple(req.extra_cmake_args)


def build_key(source_fingerprint: str, req: BuildRequest, toolchain: str = "") -> str:
    """``toolchain``: what else the build depends on (the Vulkan headers' version)."""
    h = hashlib.sha256()
    for part in (source_fingerprint, patches_hash(), req.backend, *cmake_args(req),
                 _cpu_signature() if req.native_cpu else "generic", toolchain):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def read_build(directory: Path) -> BuildInfo | None:
    """The build recorded in ``directory/build.json``, or None (absent, unreadable, partial)."""
    try:
        data = json.loads((directory / "build.json").read_text())
        data["cmake_args"] = tuple(data["cmake_args"])
        info = BuildInfo(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return info if (Path(info.lib_dir) / "libllama.so").exists() else None


def list_builds(root: Path | None = None) -> list[BuildInfo]:
    """Every finished build in the cache, newest first (current or not)."""
    root = root or cache_root()
    builds = [b for d in root.glob("*/") if (b := read_build(d)) is not None]
    return sorted(builds, key=lambda b: b.built_at, reverse=True)


def find_build(backend: str | None = None, *, rpc: bool = False) -> BuildInfo | None:
    """The newest build made from the current patches and device cache store (of ``backend``,
    if given; with ``rpc``, only a build with the RPC backend). A build with RPC serves
    everything a build without it does."""
    current = patches_hash()
    for b in list_builds():
        if (b.patches_hash == current and (backend is None or b.backend == backend)
                and (b.rpc or not rpc)):
            return b
    return None


HEARTBEAT_S = 20.0      # a progress line at least this often while something compiles


def _progress_of(log_file: Path) -> str:
    """The build tool's last step counter in the log ("[57/88]", "[ 64%]"), or ""."""
    try:
        with open(log_file, "rb") as fh:
            fh.seek(max(0, log_file.stat().st_size - 4096))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    steps = re.findall(r"\[\s*(\d+/\d+|\d+%)\]", tail)
    return steps[-1] if steps else ""


def _run(cmd: list[str], log_file: Path, *, cwd: Path | None = None, env=None,
         heartbeat: Callable[[str], None] | None = None) -> None:
    """Run ``cmd`` with its output in ``log_file``; with ``heartbeat``, a line through it every
    ``HEARTBEAT_S`` seconds (the build's step counter) until it ends."""
    with open(log_file, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        started = time.monotonic()
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S if heartbeat else None)
                break
            except subprocess.TimeoutExpired:
                step = _progress_of(log_file)
                heartbeat(f"still compiling{' ' + step if step else ''} "
                          f"({time.monotonic() - started:.0f} s)")
            except BaseException:
                proc.kill()
                proc.wait()
                raise
    if proc.returncode != 0:
        lines = log_file.read_text(errors="replace").strip().splitlines()
        errors = [ln.strip() for ln in lines if "error" in ln.lower()] or lines[-1:]
        raise UserError(f"{log_file}: {Path(cmd[0]).name} failed (exit {proc.returncode}): "
                        f"{errors[0][:300] if errors else 'no output'}")


def _apply_patches(src: Path, log_file: Path) -> None:
    for p in patch_files():
        if shutil.which("patch"):
            cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(p)]
        else:
            cmd = ["git", "apply", "-p1", str(p)]
        _run(cmd, log_file, cwd=src)


def _build_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CCACHE_BASEDIR", str(work))   # relative paths in the hash: hits across keys
    env.setdefault("CCACHE_NOHASHDIR", "1")
    return env


def _compile_store(src: Path, bin_dir: Path, log_file: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise UserError("no C++ compiler (c++ / g++) on PATH; set CXX")
    cmd = [cxx, "-std=c++17", "-O2", "-fPIC", "-shared",
           *(str(STORE_DIR / s) for s in STORE_SOURCES if s.endswith(".cpp")),
           f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-L{bin_dir}",
           "-lllama", "-lggml", "-lggml-base", "-Wl,-rpath,$ORIGIN", "-o", str(bin_dir / STORE_LIB)]
    _run(cmd, log_file)


def build(req: BuildRequest, *, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
          ) -> BuildInfo:
    """Build (or find) the patched libraries for ``req``; returns the finished build."""
    vulkan = vulkan_sdk.resolve() if req.backend == "vulkan" else None
    source = resolve_source(req.source)
    fingerprint = source.fingerprint()
    key = build_key(fingerprint, req, vulkan.fingerprint() if vulkan else "")
    root = cache_root()
    final = root / key
    found = read_build(final)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # one build at a time per cache
        found = read_build(final)
        if found is not None:
            return found
        return _build_locked(req, source, fingerprint, key, root, log, vulkan)


def _build_locked(req, source, fingerprint, key, root, log, vulkan) -> BuildInfo:
    started = time.time()
    work = root / "work" / req.backend
    shutil.rmtree(work, ignore_errors=True)
    src, bld = work / "llama.cpp", work / "build"
    work.mkdir(parents=True)
    log_file = work / "build.log"
    log(f"native build {req.backend}: source {source.path} -> {work} (log: {log_file})")
    source.extract(src)
    _apply_patches(src, log_file)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    env = _build_env(work)
    if vulkan is not None:
        env = vulkan.apply(env)
        log(f"native build vulkan: headers {vulkan.version} from {vulkan.prefix or '/usr'}")
    _run(["cmake", "-S", str(src), "-B", str(bld), *generator, *cmake_args(req)], log_file, env=env)
    jobs = req.jobs or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or os.cpu_count() or 2)
    log(f"native build {req.backend}: compiling with {jobs} job(s)")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    _run([*nice, "cmake", "--build", str(bld), "-j", str(jobs)], log_file, env=env,
         heartbeat=lambda line: log(f"native build {req.backend}: {line}"))
    bin_dir = bld / "bin"
    _compile_store(src, bin_dir, log_file)

    staging = root / f"{key}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    lib_dir = staging / "lib"
    lib_dir.mkdir(parents=True)
    for f in sorted(bin_dir.iterdir()):
        if f.name.startswith("lib") and ".so" in f.name:
            shutil.copy2(f, lib_dir / f.name, follow_symlinks=False)
    final = root / key
    info = BuildInfo(key=key, backend=req.backend, lib_dir=str(final / "lib"),
                     patches_hash=patches_hash(), source=str(source.path),
                     source_fingerprint=fingerprint, cmake_args=cmake_args(req),
                     built_at=time.time(), build_seconds=round(time.time() - started, 1),
                     rpc=req.rpc)
    (staging / "build.json").write_text(json.dumps(info.to_dict(), indent=2) + "\n")
    shutil.copy2(log_file, staging / "build.log")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    shutil.rmtree(work, ignore_errors=True)
    for old in list_builds(root):             # builds of older patches are never used again
        if old.patches_hash != info.patches_hash:
            shutil.rmtree(Path(old.lib_dir).parent, ignore_errors=True)
    log(f"native build {req.backend}: done in {info.build_seconds:.0f} s -> {info.lib_dir}")
    return info
