"""Argument checks shared by the allocator's constructors and planners (and the SGLang
bridge built on them): a bad value is refused naming it and what was expected."""

from __future__ import annotations


def check_count(name: str, value: object, minimum: int) -> int:
    """`value` if it is an int (not a bool) of at least `minimum`; else a ValueError naming
    `name`, the value and the floor."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}, expected an int >= {minimum}")
    return value
