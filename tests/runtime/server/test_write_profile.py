"""``serve --write-profile``: the real server, driven by the official ``openai`` client, writes
the routing profile of what it generated when it is stopped, and a later run loads it."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from runtime.residency.profile import read_profile
from runtime.traces.model_header import header_from_model

REPO_ROOT = Path(__file__).resolve().parents[3]
MAX_TOKENS = 12


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_profile_written_on_exit(start_server, tiny_model: Path, tmp_path: Path, sig) -> None:
    target = tmp_path / "served.profile.npz"
    server = start_server(tiny_model, "--write-profile", str(target), "-c", "256")
    client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)
    generated = 0
    for prompt in ("the king saw a river", "an old house near the"):
        r = client.completions.create(model="x", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
        generated += r.usage.completion_tokens
    chat = client.chat.completions.create(model="x", max_tokens=MAX_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": "a story"}])
    generated += chat.usage.completion_tokens
    assert not target.exists()                     # written on exit, not before
    server.proc.send_signal(sig)
    server.proc.wait(timeout=60)                   # (uvicorn re-raises the signal at the end)
    assert "Traceback" not in server.log()
    assert f"-> {target}" in server.log()
    prof = read_profile(target)
    header = header_from_model(tiny_model)
    prof.check_model(header.n_layer, header.n_expert, header.expert_bytes, str(target))
    # one count per generated token and MoE layer: each decode token routes top-2 distinct
    # experts at each of the 4 MoE layers (the first token of an answer comes from prefill)
    assert 0 < prof.decode_tokens <= generated
    assert np.allclose(prof.frequency.sum(axis=1), 2.0)
    assert prof.count.sum() == prof.decode_tokens * 2 * (header.n_layer - 1)
    assert list(tmp_path.iterdir()) == [target]   # the scratch trace is gone
    # the profile warm-starts a later run
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "complete", "-m", str(tiny_model),
                          "-p", "the king", "-n", "4", "--profile", str(target)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr


def test_no_generation_writes_no_profile(start_server, tiny_model: Path, tmp_path: Path) -> None:
    target = tmp_path / "none.profile.npz"
    server = start_server(tiny_model, "--write-profile", str(target))
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(timeout=60)
    assert not target.exists() and list(tmp_path.iterdir()) == []
    assert "not written (no token was generated)" in server.log()


def test_profile_directory_must_exist(tiny_model: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "-m", str(tiny_model),
                        "--port", "0", "--write-profile", str(tmp_path / "no" / "p.npz")],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("moe-offload: error")]
    assert len(errors) == 1 and "does not exist" in errors[0]
