"""Broken files for the no-poisoned-state tests: a served model's copy to cut, rewrite or
fill with NaN, and a small full file system for the writers.

``model_copy(model, dir)`` copies a model (the copy may be broken; the session's fixture stays
whole); ``tensor_range(path, name)`` is a tensor's (offset, bytes) in the file;
``poison_experts(path, value)`` writes ``value`` (NaN, Inf) over every routed expert's f32
weights in place, keeping the file's size and modification time (a damaged file, as bit rot or
a bad conversion leaves it); ``restore_bytes(path, source, loaded)`` writes ``source``'s bytes
back in place with the modification time of ``loaded`` (``cp -p`` over the same file).
``small_filesystem(dir, bytes)``: a tmpfs of that size mounted at ``dir`` (root only; None
where mounting is refused).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFReader


def model_copy(model: Path, directory: Path) -> Path:
    copy = directory / model.name
    shutil.copyfile(model, copy)
    return copy


def tensor_range(path: Path, name: str) -> tuple[int, int]:
    """(absolute offset, bytes) of tensor ``name``'s data in the GGUF at ``path``."""
    for t in GGUFReader(path).tensors:
        if t.name == name:
            return int(t.data_offset), int(t.n_bytes)
    raise KeyError(name)


def _keep_mtime(path: Path):
    st = os.stat(path)
    return lambda: os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def poison_experts(path: Path, value: float) -> None:
    """Every routed expert's weights (f32 ``*_exps.weight``) set to ``value``, in place."""
    put_back = _keep_mtime(path)
    tensors = [t for t in GGUFReader(path).tensors if "_exps." in t.name]
    assert tensors and all(t.tensor_type.name == "F32" for t in tensors), "an f32 MoE model"
    with open(path, "r+b") as f:
        for t in tensors:
            f.seek(int(t.data_offset))
            f.write(np.full(int(t.n_bytes) // 4, value, np.float32).tobytes())
    put_back()


def restore_bytes(path: Path, source: Path, loaded: os.stat_result | None = None) -> None:
    """``source``'s bytes over ``path``, in place (the same inode), and the modification time
    ``path`` had at ``loaded`` (default: now's, kept)."""
    put_back = _keep_mtime(path)
    with open(path, "r+b") as f:
        f.write(source.read_bytes())
        f.truncate()
    if loaded is None:
        put_back()
    else:
        os.utime(path, ns=(loaded.st_atime_ns, loaded.st_mtime_ns))


@contextlib.contextmanager
def small_filesystem(directory: Path, size: int) -> Iterator[Path | None]:
    """A tmpfs of ``size`` bytes at ``directory`` (made), unmounted after; None when this
    process may not mount one (not root, or a container without the capability)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield None
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(directory)], capture_output=True).returncode == 0
    try:
        yield directory if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)
