"""Where moe-offload keeps what it writes or builds once and reuses: synthetic models, the
compiled helpers, the native llama.cpp builds.

The root is ``$MOE_OFFLOAD_CACHE``, else ``$XDG_CACHE_HOME/moe-offload``, else
``~/.cache/moe-offload``; each user of it takes one subfolder (``models``, ``engine``,
``clib``, ``native``).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from runtime.errors import UserError


def cache_dir(*parts: str) -> Path:
    """The cache root, or a folder below it (not created here)."""
    root = os.environ.get("MOE_OFFLOAD_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        root = os.path.join(base, "moe-offload")
    return Path(root).joinpath(*parts)


def model_path(spec, directory: Path | None = None) -> Path:
    """Where the synthetic model of ``spec`` (a SynthSpec) is cached: the name carries the
    shape and a hash of the whole spec, so a changed spec gets a new file."""
    digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:12]
    directory = cache_dir("models") if directory is None else Path(directory)
    return directory / (f"{spec.arch}-{spec.layers}L-{spec.experts}E-top{spec.top_k}-"
                        f"{spec.dtype}-{digest}.gguf")


def cached_model(spec, directory: Path | None = None, *, progress: bool = True) -> Path:
    """The cached synthetic model of ``spec``, written first if missing (the writer renames a
    finished temp file into place, so an interrupted write leaves nothing behind). A bar on
    stderr when writing takes more than a couple of seconds; UserError when it cannot write."""
    from gguf_tools.synth import planned_data_bytes, write_synthetic_model  # noqa: PLC0415

    path = model_path(spec, directory)
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{path.parent}: cannot create ({exc.strerror or exc})") from None
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=planned_data_bytes(spec), unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"writing {path.name}", file=sys.stderr, leave=False, delay=2.0)
    try:
        write_synthetic_model(path, spec, progress=bar.update if bar is not None else None)
    except OSError as exc:
        raise UserError(f"{path}: write failed ({exc.strerror or exc})") from None
    finally:
        if bar is not None:
            bar.close()
    return path
