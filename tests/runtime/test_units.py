from __future__ import annotations

import pytest

from runtime.units import format_size, parse_percent, parse_size


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * 2**30), ("512 MiB", 512 * 2**20), ("1KiB", 1024), ("2TiB", 2 * 2**40),
    ("1.5GB", 1_500_000_000), ("3KB", 3000), ("7MB", 7_000_000), ("4096", 4096), ("10B", 10),
    ("1gib", 2**30), (4096, 4096), ("0.5KiB", 512),
])
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5GiB", "0", "0GiB", "5XB", "80%", "GiB", "1.2.3MB",
                                  -1, 0, True, None])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_message_is_one_line():
    with pytest.raises(ValueError) as err:
        parse_size("5XB")
    assert "\n" not in str(err.value) and "XB" in str(err.value)


def test_parse_percent():
    assert parse_percent("80%") == pytest.approx(0.8)
    assert parse_percent(" 12.5 % ") == pytest.approx(0.125)
    assert parse_percent("6GiB") is None
    with pytest.raises(ValueError):
        parse_percent("150%")
    with pytest.raises(ValueError):
        parse_percent("0%")


def test_format_size():
    assert format_size(6 * 2**30) == "6.00 GiB"
    assert format_size(100) == "100 B"
