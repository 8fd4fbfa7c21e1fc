"""argparse types for numbers and sizes: finite, within a range, one line when refused.

`number(float, lo=0, lo_open=True)` refuses `nan`, `inf`, and anything out of range
with a message naming the value and the range expected; `one_line_errors(parser)`
makes argparse print it as one line and exit 2. `join_negative_values(argv)` lets
`--budget -5GiB` reach the type as a value (argparse would take `-5GiB` for an option),
so the value is refused by name instead of "expected one argument".
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from accounting.units import parse_size

N = TypeVar("N", int, float)


def number(
    kind: type[N], lo: float | None = None, hi: float | None = None, *, lo_open: bool = False
) -> Callable[[str], N]:
    """A parser of `kind` (int or float) in [lo, hi] (or (lo, hi] with `lo_open`)."""

    def shown(x: float) -> str:
        return str(int(x)) if kind is int else f"{x:g}"

    low = "" if lo is None else ("> " if lo_open else ">= ") + shown(lo)
    high = "" if hi is None else f"<= {shown(hi)}"
    expected = " and ".join(x for x in (low, high) if x)
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        too_low = lo is not None and (value <= lo if lo_open else value < lo)
        if too_low or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} {expected}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def size(lo: int = 1, hi: int | None = None) -> Callable[[str], int]:
    """A byte size (`512MiB`, `1.5GB`, `4096`) in [lo, hi]."""

    def parse(text: str) -> int:
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"{text!r}: negative, expected a size >= {lo} bytes")
        try:
            value = parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"{text!r}: expected a size {bound} bytes")
        return value

    parse.__name__ = "size"
    return parse


# What argparse's own test for negative numbers (`-1`, `-.5`) misses: `-5GiB`, `-1e3`.
_NEGATIVE = re.compile(r"-\.?[0-9]")


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """`argv` with every `--option -5GiB` written `--option=-5GiB`, so that argparse hands the
    negative-looking value to the option's type (which refuses it by name) instead of taking
    it for an option and saying "expected one argument". Nothing after `--` is touched."""
    args = list(argv)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        following = args[i + 1] if i + 1 < len(args) else None
        if (
            arg.startswith("--")
            and "=" not in arg
            and following is not None
            and _NEGATIVE.match(following)
        ):
            out.append(f"{arg}={following}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make `parser` report a bad argument as one line (`PROG: error: ...; see --help`) and
    exit 2, instead of the usage block then the error."""

    def error(message: str) -> NoReturn:
        print(f"{parser.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    parser.error = error  # type: ignore[method-assign]
