"""Shared pytest fixtures: synthetic MoE GGUF models written once per session, and the one
llama.cpp every test runs on.

``tiny_model``: qwen3moe, f32, 4 layers, 8 experts, top-2, embd 64, expert ff 32, skewed
routing (a few MB). ``synth_model_factory(spec)``: writes any ``SynthSpec`` once per session
(cached by spec) and returns its path. ``terminal_notice(line)``: a line on pytest's terminal
while a fixture works for minutes (the native build), past its output capture.
``llama_build``: this install's patched llama.cpp (runtime.native.install.default_build, made
by ``pip install -e .``); the session checks it exists before any test runs and builds it
once if not (patches changed by a pull, an install with MOE_OFFLOAD_SKIP_NATIVE_BUILD), with a
line on the terminal at least every ``BUILD_NOTICE_S``. No test compiles another CPU build.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import pytest

from gguf_tools.synth import SynthSpec, write_synthetic_model

_CONFIG: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config


def terminal_notice(line: str) -> None:
    """Write ``line`` on pytest's terminal now, through its terminal writer with capture
    suspended (a captured stream, even sys.__stderr__ under fd capture, shows nothing until
    the test ends: a first run looked frozen for minutes while the native build ran)."""
    plugins = _CONFIG.pluginmanager if _CONFIG is not None else None
    reporter = plugins.get_plugin("terminalreporter") if plugins is not None else None
    if reporter is None:
        print(line, file=sys.__stderr__, flush=True)
        return
    capture = plugins.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        reporter.ensure_newline()
        reporter.write_line(line)
        reporter.flush()


BUILD_NOTICE_S = 30.0      # at most this long without a line on the terminal while building
_LLAMA_BUILD = None        # this session's BuildInfo (ensure_llama_build)


class _BuildProgress:
    """``say(line)`` on the terminal, and "still building (N s)" whenever ``every`` seconds
    pass without a line (the build's own heartbeat covers compiling only, not extracting the
    source or configuring)."""

    def __init__(self, prefix: str, every: float = BUILD_NOTICE_S):
        self.prefix, self.every = prefix, every
        self.started = self.last = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def __call__(self, line: str) -> None:
        with self.lock:
            self.last = time.monotonic()
            terminal_notice(f"{self.prefix}{line}")

    def _tick(self) -> None:
        while not self.done.wait(max(0.0, self.every - (time.monotonic() - self.last)) + 0.1):
            if time.monotonic() - self.last >= self.every:
                self(f"still building ({time.monotonic() - self.started:.0f} s)")

    def __enter__(self) -> "_BuildProgress":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def build_with_progress(req, who: str):
    """``runtime.native.build.build(req)`` (instant when built), its lines on the terminal
    with ``who`` in front, and one at least every ``BUILD_NOTICE_S`` while it works."""
    from runtime.native.build import build

    with _BuildProgress(f"[{who}, once per cache] ") as say:
        return build(req, log=say)


def ensure_llama_build():
    """This install's patched llama.cpp (BuildInfo): the recorded one when current, else built
    here as ``pip install -e .`` builds it (CMAKE_ARGS picks the backend) and recorded as the
    install's unless the install chose another backend. Once per session."""
    global _LLAMA_BUILD
    if _LLAMA_BUILD is None:
        from runtime.native.install import (RECORD, default_build, installed_backend,
                                            record_install, request_from_cmake_args)
        from runtime.native.source import cache_root

        info = default_build()
        if info is None:
            req = request_from_cmake_args()
            terminal_notice(f"[tests] no current build of this install's llama.cpp in "
                            f"{cache_root()}: building it ({req.backend}, minutes)")
            info = build_with_progress(req, "tests")
            if not (cache_root() / RECORD).is_file() or installed_backend() == info.backend:
                record_install(info)
        _LLAMA_BUILD = info
    return _LLAMA_BUILD


def pytest_sessionstart(session: pytest.Session) -> None:
    """The one llama.cpp exists before the first test (one build, said on the terminal,
    rather than a build inside whichever test needs it first)."""
    from runtime.errors import UserError

    try:
        ensure_llama_build()
    except UserError as exc:
        pytest.exit(f"this install's patched llama.cpp cannot be built: {exc}", returncode=1)


@pytest.fixture(scope="session")
def llama_build():
    """This install's patched llama.cpp (a runtime.native.build.BuildInfo): the library every
    test process loads unless it chooses one."""
    return ensure_llama_build()


TINY_SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=64, ff=32,
                      dtype="f32", seed=0, skew=1.0)


@pytest.fixture(scope="session")
def synth_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[SynthSpec], Path]:
    """Callable ``SynthSpec -> Path``; each distinct spec is written once per session."""
    root = tmp_path_factory.mktemp("synth-models")
    cache: dict[SynthSpec, Path] = {}
    lock = threading.Lock()

    def make(spec: SynthSpec) -> Path:
        with lock:
            path = cache.get(spec)
            if path is None:
                path = write_synthetic_model(root / f"model-{len(cache)}-{spec.arch}.gguf", spec)
                cache[spec] = path
            return path

    return make


@pytest.fixture(scope="session")
def tiny_spec() -> SynthSpec:
    """The spec ``tiny_model`` is written from."""
    return TINY_SPEC


@pytest.fixture(scope="session")
def tiny_model(synth_model_factory: Callable[[SynthSpec], Path]) -> Path:
    """Path to a small qwen3moe f32 model with skewed routing (session-wide, read-only)."""
    return synth_model_factory(TINY_SPEC)


def write_dense_gguf(path: Path) -> Path:
    """A one-layer GGUF with no routed experts (a dense model's layout, not loadable)."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
