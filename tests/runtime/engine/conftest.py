"""Engine test helpers: settings that keep llama.cpp to one thread (the test machines are
small and shared; spinning worker threads on a busy core make prefill crawl)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.engine.types import EngineSettings

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPT = "The quick brown fox"


def settings(model: Path, **kw) -> EngineSettings:
    """EngineSettings for tests: small context, one thread."""
    base = dict(model_path=str(model), n_ctx=512, n_threads=1, n_threads_batch=1)
    base.update(kw)
    return EngineSettings(**base)


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m runtime.cli ARGS`` as a subprocess, text mode."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                          env=env)


@pytest.fixture(scope="session")
def make_settings():
    """``make_settings(model, **overrides) -> EngineSettings`` (one thread, n_ctx 512)."""
    return settings


@pytest.fixture(scope="session")
def cli():
    """``cli(*args, stdin=None) -> CompletedProcess`` running ``python -m runtime.cli``."""
    return run_cli


@pytest.fixture(scope="session")
def prompt() -> str:
    return PROMPT
