from __future__ import annotations

import pytest

from accounting.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 << 30),
        ("512MiB", 512 << 20),
        ("512 MiB", 512 << 20),
        ("4096", 4096),
        ("4096B", 4096),
        ("1.5GiB", 3 << 29),
        ("2G", 2 << 30),
        ("1kib", 1024),
        ("1GB", 10**9),
        ("3TB", 3 * 10**12),
        ("1TiB", 1 << 40),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "expected a byte size"),
        ("GiB", "expected a byte size"),
        ("-1GiB", r"size '-1GiB': negative, expected a size >= 0"),
        (" -0.5MiB", r"size ' -0.5MiB': negative, expected a size >= 0"),
        ("-", "negative, expected a size >= 0"),
        ("12 parsecs", "unknown unit 'parsecs'"),
        ("1.3B", "whole number of bytes"),
        ("0.1KiB", "whole number of bytes"),
        (-5, r"size -5: negative, expected a size >= 0"),
        (True, "expected a byte size"),
    ],
)
def test_parse_size_refuses(text: str | int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(80 << 30) == "80.00 GiB"
