"""The default benchmark model: a synthetic MoE model big enough that paging matters.

Written once into the cache's ``models/`` folder (``runtime/cache.py``: ``~/.cache/moe-offload``,
``$MOE_OFFLOAD_CACHE`` overrides the root) and reused; the file name carries the spec's digest,
so a changed spec writes a new file.
The same model by hand::

    moe-offload synth bench.gguf --arch qwen3moe --layers 24 --experts 64 --top-k 4 \\
        --embd 1024 --ff 512 --dtype q8_0 --skew 1.0

(2.6 GB; experts are 2.5 GB of it: 24 layers x 64 experts x 1.6 MiB, 4 used per token.)
"""
from __future__ import annotations

from pathlib import Path

from gguf_tools.synth import SynthSpec
from runtime.cache import cached_model

BENCH_SPEC = SynthSpec(arch="qwen3moe", layers=24, experts=64, top_k=4, embd=1024, ff=512,
                       dtype="q8_0", seed=0, skew=1.0)


def ensure_model(spec: SynthSpec = BENCH_SPEC, *, progress: bool = True) -> Path:
    """The cached benchmark model (``runtime.cache.cached_model``)."""
    return cached_model(spec, progress=progress)
