"""``moe-offload demo``: writes the default model once into the cache directory, prints its
expert table, generates through the offload runtime and closes with the telemetry line."""
from __future__ import annotations

import re


def test_demo_main_job(cli, tmp_path):
    args = ["demo", "--model-dir", str(tmp_path), "-n", "12", "-t", "1"]
    first = cli(*args, timeout=300)
    assert first.returncode == 0, first.stderr
    models = list(tmp_path.glob("*.gguf"))
    assert len(models) == 1
    out = first.stdout
    assert "layer" in out and "bytes/expert" in out            # inspect's table
    assert "$ moe-offload complete -m" in out and "--devices.cpu" in out
    assert "of the model's" in out and "of the free RAM" in out     # a budget, of what
    line = next(l for l in out.splitlines() if l.startswith("prompt: "))
    rate = re.search(r"expert hit rate: ([0-9.]+)%", line)
    assert rate and 0 <= float(rate.group(1)) <= 100
    assert re.search(r"decode +accesses +\d+", out)
    assert "weights are random" in out and "moe-offload complete -hf" in out   # what next
    assert "-hf ggml-org/" in out                               # the README's repository
    mtime = models[0].stat().st_mtime_ns
    second = cli(*args, timeout=300)
    assert second.returncode == 0, second.stderr
    assert models[0].stat().st_mtime_ns == mtime               # cached, not rewritten
