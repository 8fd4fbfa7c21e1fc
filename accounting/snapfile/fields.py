"""One JSON value of a snapshot file, parsed and checked: types, ranges, lengths.

Each checker takes a parsed object, a key and where it is (`accounts[3]`), and
returns the value typed, or raises `Refused` ("schema") naming the field, the value
(cut to 60 characters) and what was expected: finite, non-negative figures, integers
within 64 bits, names of bounded length, lists of bounded size. `parse_json` refuses
bytes that are not JSON ("parse") or nested deeper than the parser allows ("nesting").
"""

from __future__ import annotations

import json
import math
from typing import Any

from accounting.buffers import Owner
from accounting.snapfile.refusal import Refused, fail

MAX_NAME = 256  # characters in a name, label or dtype
MAX_TEXT = 4096  # characters in a free-text field (reasons, errors)
MAX_LABELS = 32
MAX_ROWS = 100_000  # buffers or accounts in one snapshot
MAX_DIMS = 8
MAX_INT = 2**63 - 1
OWNERS = frozenset(o.value for o in Owner)

INT = {int}
STR = {str}
DICT = {dict}


def parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise Refused("nesting", "JSON nested deeper than the parser allows") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused("parse", f"not JSON: {e}") from None


def as_dict(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise fail(where, f"expected an object, got {type(d).__name__}")
    return d


def as_list(d: Any, where: str, limit: int = MAX_ROWS) -> list[Any]:
    if not isinstance(d, list):
        raise fail(where, f"expected a list, got {type(d).__name__}")
    if len(d) > limit:
        raise fail(where, f"{len(d)} entries, expected at most {limit}")
    return d


def get_field(d: dict[str, Any], key: str, where: str) -> Any:
    try:
        return d[key]
    except KeyError:
        raise fail(where, f"missing {key!r}") from None


def int_of(d: dict[str, Any], key: str, where: str, *, lo: int = 0) -> int:
    v = get_field(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_INT:
        raise fail(where, f"{key}={v!r:.60}, expected an integer >= {lo}")
    return v


def opt_int_of(d: dict[str, Any], key: str, where: str, *, lo: int = 0) -> int | None:
    return None if d.get(key) is None else int_of(d, key, where, lo=lo)


def num_of(d: dict[str, Any], key: str, where: str) -> float:
    v = get_field(d, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise fail(where, f"{key}={v!r:.60}, expected a finite number >= 0")
    return float(v)


def str_of(d: dict[str, Any], key: str, where: str, limit: int = MAX_NAME) -> str:
    v = get_field(d, key, where)
    if not isinstance(v, str) or len(v) > limit:
        raise fail(where, f"{key}: expected a string of at most {limit} characters")
    return v


def owner_of(d: dict[str, Any], where: str) -> Owner:
    v = get_field(d, "owner", where)
    if type(v) is not str or v not in OWNERS:
        raise fail(where, f"owner={v!r:.60}, expected one of {sorted(OWNERS)}")
    return Owner(v)


def labels_of(d: Any) -> dict[str, str]:
    labels = as_dict(d, "labels")
    if len(labels) > MAX_LABELS:
        raise fail("labels", f"{len(labels)} labels, expected at most {MAX_LABELS}")
    for k, v in labels.items():
        if not isinstance(v, str) or len(k) > MAX_NAME or len(v) > MAX_NAME:
            raise fail("labels", f"{k!r:.60}: expected short string keys and values")
    return dict(labels)


def scalars_of(d: Any, where: str) -> dict[str, Any]:
    """A flat object of short strings, finite numbers, booleans and nulls."""
    d = as_dict(d, where)
    if len(d) > MAX_LABELS:
        raise fail(where, f"{len(d)} entries, expected at most {MAX_LABELS}")
    for k, v in d.items():
        ok = v is None or isinstance(v, (bool, int)) or (isinstance(v, str) and len(v) <= MAX_TEXT)
        ok = ok or (isinstance(v, float) and math.isfinite(v))
        if not ok or len(k) > MAX_NAME:
            raise fail(where, f"{k!r:.60}: expected a string, finite number, boolean or null")
    return dict(d)


# -- the common case, checked a whole list at a time with C-level builtins ----------------------
def plain_rows(rows: list[Any], keys: frozenset[str]) -> bool:
    """Every row a dict with as many keys as `keys` (the caller's itemgetters over all of
    `keys` then raise KeyError unless each row has exactly those)."""
    return set(map(type, rows)) == DICT and set(map(len, rows)) == {len(keys)}


def plain_ints(values: list[Any]) -> bool:
    """Every value an int in [0, MAX_INT] (C-level builtins over the whole list)."""
    return not values or (
        set(map(type, values)) == INT and min(values) >= 0 and max(values) <= MAX_INT
    )


def plain_strs(values: list[Any], limit: int = MAX_NAME) -> bool:
    """Every value a string of at most `limit` characters."""
    return not values or (set(map(type, values)) == STR and max(map(len, values)) <= limit)
