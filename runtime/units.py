"""Byte sizes with units: ``parse_size("6GiB") == 6 * 2**30``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB) powers of
1000, ``B`` (or no unit) is bytes. Percentages ("80%") are shares, not sizes: callers decide
what they are a share of, with :func:`parse_percent`.
"""
from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` ("6GiB", "512 MiB", "1.5GB", "4096", or an int).

    Raises ``ValueError`` with a one-line reason on anything else, including zero, negative
    numbers and percentages; callers wrap it in a ``UserError`` naming their file and key.
    Fractional results are rounded down to whole bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        return int(text)
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r}")
    stripped = text.strip()
    if stripped.startswith("-"):
        raise ValueError(f"size must be positive, got {text!r}")
    if _PERCENT_RE.match(stripped):
        raise ValueError(f"expected a size with units, got a percentage {text!r}")
    match = _SIZE_RE.match(stripped)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 6GiB, 512MiB, 1.5GB, 4096)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"unknown unit {unit!r} in {text!r} (valid: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    value = int(float(number) * factor) if "." in number else int(number) * factor
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def parse_percent(text: str) -> float | None:
    """The share in ``"80%"`` as a fraction (0.8); None when ``text`` is not a percentage.

    Raises ``ValueError`` for a percentage outside (0, 100].
    """
    if not isinstance(text, str):
        return None
    match = _PERCENT_RE.match(text)
    if not match:
        return None
    share = float(match.group(1)) / 100.0
    if not 0.0 < share <= 1.0:
        raise ValueError(f"percentage must be in (0%, 100%], got {text!r}")
    return share


def format_ranges(numbers) -> str:
    """Ascending integers as runs: ``format_ranges([0, 1, 2, 3, 5, 7, 8, 9]) == "0-3,5,7-9"``."""
    out, run = [], []
    for n in numbers:
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def format_size(n_bytes: int) -> str:
    """Human-readable binary size: ``format_size(6 * 2**30) == "6.00 GiB"``."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} TiB"


def parse_size_arg(text: str, where: str) -> int:
    """``parse_size`` for a command-line value: a UserError naming ``where`` (the flag)."""
    from runtime.errors import UserError  # noqa: PLC0415

    try:
        return parse_size(text)
    except ValueError as err:
        raise UserError(f"{where}: {err}") from None
