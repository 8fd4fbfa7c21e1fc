"""Frozen dataclass records built from values already checked, without their `__init__`.

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__`
(about 0.2-0.4 us a field). Where records are built on every new version of a snapshot
file (account, family and holder rows: tens a rank, every publish of every rank), the
caller has checked the values already, so `record_maker(cls)` returns a function that
sets every field at once through the instance's `__dict__`: the same instance, equal,
hashing and printing as one built by `cls(...)`. It holds while `cls` has no
`__post_init__` (nothing would run it) and no `__slots__` (no `__dict__`); `record_maker`
refuses such a class, so a change there fails at import, not silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def record_maker(cls: type[T]) -> Callable[..., T]:
    """`make(*values)`: an instance of `cls` with its fields, in declaration order, set to
    `values` (every field given; no defaults, no checks)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"record_maker: {cls!r} is not a dataclass")
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        raise TypeError(
            f"record_maker: {cls.__name__} has __post_init__ or __slots__; expected a plain "
            "dataclass (build it through its __init__)"
        )
    names = tuple(f.name for f in dataclasses.fields(cls))
    new = object.__new__

    def make(*values: Any) -> T:
        obj = new(cls)
        obj.__dict__.update(zip(names, values, strict=True))
        return obj

    make.__doc__ = f"A {cls.__name__} of ({', '.join(names)}), without its __init__."
    return make
