"""Slot ids as callers pass them (tensors, sequences, ints) and their checks against a pool."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from allocator.errors import SlotError


def as_id_list(ids: Any) -> list[int]:
    """Slot ids from a tensor, an array, a sequence of ints or an int; SlotError otherwise."""
    dtype = getattr(ids, "dtype", None)
    if dtype is not None and hasattr(ids, "tolist"):
        # A tensor (or array): one check of its dtype instead of one per element.
        if (
            getattr(dtype, "is_floating_point", False)
            or getattr(dtype, "is_complex", False)
            or str(dtype) in ("torch.bool", "bool")
        ):
            raise SlotError(f"slot ids of dtype {dtype}, expected an integer dtype")
        out = ids.tolist()
        if not isinstance(out, list):
            out = [out]
        if not out or type(out[0]) is int:
            return out
    elif isinstance(ids, int):
        out = [ids]
    elif isinstance(ids, Iterable):
        out = list(ids)
    else:
        raise SlotError(f"ids={ids!r}, expected a tensor, a sequence of ints or an int")
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            raise SlotError(f"slot id {i!r} is not an int")
    return out


def validate(
    slots: list[int],
    op: str,
    *,
    occupied: bytearray,
    null: int | None,
    name: str,
    want_occupied: bool,
) -> None:
    """Refuse ids out of range, the null slot, duplicates and ids not in the wanted state
    (`occupied[i]`), with a SlotError naming the first; nothing is changed here."""
    cap = len(occupied)
    want = int(want_occupied)
    # One comprehension over the ids (the common case: all fine), then the details.
    bad = [i for i in slots if not 0 <= i < cap or occupied[i] != want]
    if (
        not bad
        and len(set(slots)) == len(slots)
        and (null is None or not occupied[null] or null not in slots)
    ):
        return
    seen: set[int] = set()
    for i in slots:
        if not 0 <= i < cap:
            raise SlotError(f"{name}.{op}: slot id {i} is out of range, expected 0 <= id < {cap}")
        if i == null and occupied[i]:
            raise SlotError(f"{name}.{op}: slot id {i} is the reserved null slot")
        if i in seen:
            raise SlotError(f"{name}.{op}: slot id {i} appears twice in one call")
        seen.add(i)
        if occupied[i] != want:
            state = "free (double free or foreign id)" if want_occupied else "already occupied"
            raise SlotError(f"{name}.{op}: slot id {i} is {state}")
