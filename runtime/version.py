"""This package's version and the llama.cpp bindings' under it (``--version``, the server's
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


def version_line() -> str:
    """``moe-offload --version``: ours, and the llama.cpp bindings underneath."""
    def of(dist: str) -> str:
        return package_version(dist) or "not installed"

    return f"moe-offload {of('moe-offload')} (llama-cpp-python {of('llama-cpp-python')})"
