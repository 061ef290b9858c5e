"""Shared pytest fixtures: synthetic MoE GGUF models written once per session.

``tiny_model``: qwen3moe, f32, 4 layers, 8 experts, top-2, embd 64, expert ff 32, skewed
routing (a few MB). ``synth_model_factory(spec)``: writes any ``SynthSpec`` once per session
(cached by spec) and returns its path. ``terminal_notice(line)``: a line on pytest's terminal
while a fixture works for minutes (the native build), past its output capture.
"""
from __future__ import annotations

import socket
import sys
import threading
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
