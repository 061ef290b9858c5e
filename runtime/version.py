"""This package's version and the llama.cpp under it (``--version``, the server's
fingerprint)."""
from __future__ import annotations


def package_version(dist: str) -> str | None:
    """``dist``'s installed version, or None when it is not installed."""
    # imported here: the CLI imports this module before its Ctrl-C handling is in place, and
    # importlib.metadata takes a while to import (email, zipfile ...)
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# what our llama.cpp is: llama-cpp-python's vendored llama.cpp (upstream commit), patched
LLAMA_CPP = "llama.cpp 0c1e57098 (llama-cpp-python 0.3.36's) + moe-offload's patches"


def version_line() -> str:
    """``moe-offload --version``: ours, and the llama.cpp underneath."""
    return f"moe-offload {package_version('moe-offload') or 'not installed'} ({LLAMA_CPP})"
