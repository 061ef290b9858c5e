"""This package's version and the llama.cpp bindings' under it (``--version``, the server's
fingerprint)."""
from __future__ import annotations

from importlib import metadata


def package_version(dist: str) -> str | None:
    """``dist``'s installed version, or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """``moe-offload --version``: ours, and the llama.cpp bindings underneath."""
    def of(dist: str) -> str:
        return package_version(dist) or "not installed"

    return f"moe-offload {of('moe-offload')} (llama-cpp-python {of('llama-cpp-python')})"
