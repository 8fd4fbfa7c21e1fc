"""Byte sizes written by people: ``80GiB``, ``512MiB``, ``1.5GB``, ``4096``.

Binary units (KiB, MiB, GiB, TiB; also K/M/G/T and KB-style spellings with an
``i``) are powers of 1024; decimal units (kB, MB, GB, TB) are powers of 1000;
``B`` or no unit is plain bytes. The result must be a whole number of bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")
_EXPECTED = "a byte size such as 80GiB, 512MiB, 1.5GB or 4096"


def parse_size(text: str | int) -> int:
    """Bytes in `text`; ValueError naming the value and what was expected otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"size {text!r}: expected {_EXPECTED}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text!r}: negative, expected a size >= 0")
        return text
    if text.strip().startswith("-"):
        raise ValueError(f"size {text!r}: negative, expected a size >= 0 such as 80GiB")
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"size {text!r}: expected {_EXPECTED}")
    number, unit = m.groups()
    scale = UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"size {text!r}: unknown unit {unit!r}, expected one of "
            "B, KiB, MiB, GiB, TiB, kB, MB, GB, TB"
        )
    value = Fraction(number) * scale
    if value.denominator != 1:
        raise ValueError(f"size {text!r} is {float(value)} bytes: expected a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """Short binary rendering for tables: 1536 -> '1.50 KiB'; under 1 KiB in bytes."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
