"""The default benchmark model: a synthetic MoE model big enough that paging matters.

Written once into ``~/.cache/moe-offload/models/`` (``$MOE_OFFLOAD_CACHE`` overrides the root)
and reused; the file name carries the spec's digest, so a changed spec writes a new file.
The same model by hand::

    moe-offload synth bench.gguf --arch qwen3moe --layers 24 --experts 64 --top-k 4 \\
        --embd 1024 --ff 512 --dtype q8_0 --skew 1.0

(2.6 GB; experts are 2.5 GB of it: 24 layers x 64 experts x 1.6 MiB, 4 used per token.)
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gguf_tools.synth import SynthSpec, planned_data_bytes, write_synthetic_model

BENCH_SPEC = SynthSpec(arch="qwen3moe", layers=24, experts=64, top_k=4, embd=1024, ff=512,
                       dtype="q8_0", seed=0, skew=1.0)


def cache_dir() -> Path:
    """Where generated models live (created on demand)."""
    root = os.environ.get("MOE_OFFLOAD_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moe-offload")
    return Path(root) / "models"


def model_path(spec: SynthSpec = BENCH_SPEC) -> Path:
    """The cache path for ``spec`` (may not exist yet)."""
    digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:12]
    return cache_dir() / f"bench-{spec.arch}-{spec.layers}L-{spec.experts}E-{spec.dtype}-{digest}.gguf"


def ensure_model(spec: SynthSpec = BENCH_SPEC, *, progress: bool = True) -> Path:
    """The cached model for ``spec``, written first if missing (atomic rename, so a killed
    write never leaves a partial file)."""
    path = model_path(spec)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=planned_data_bytes(spec), unit="B", unit_scale=True,
                   desc=f"writing {path.name}", leave=False)
    try:
        write_synthetic_model(path, spec, progress=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    return path
