"""The schema of a published snapshot file, field by field: what `exporter.validate` checks.

Each checker takes the parsed JSON of one part (a buffer row, an account row, a
reconciliation entry, the TP status, the labels) and returns it typed, or raises
`Refused` with a reason from `REASONS` and a one-line detail naming the field, the
value (cut to 60 characters) and what was expected: finite, non-negative figures,
integers within 64 bits, names of bounded length, lists of bounded size.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.snapshot import AccountRow, BufferRow
from accounting.tp_status import TP_COUNTERS, TpStatus

MAX_NAME = 256  # characters in a name, label or dtype
MAX_TEXT = 4096  # characters in a free-text field (reasons, errors)
MAX_LABELS = 32
MAX_ROWS = 100_000  # buffers or accounts in one snapshot
MAX_DIMS = 8
MAX_INT = 2**63 - 1
OWNERS = frozenset(o.value for o in Owner)

# Why a file, or its buffer map, is not served: a small fixed set, so a metric labelled by it
# stays bounded.
REASONS = (
    "symlink",  # a symbolic link
    "not_regular",  # a FIFO, device, socket or directory
    "owner",  # owned by a user the directory rules do not trust
    "too_large",  # over the size cap
    "open",  # the operating system refused to open or read it
    "parse",  # not UTF-8 JSON in the envelope-then-rows layout
    "nesting",  # nested deeper than the parser allows
    "schema",  # parsed, but a field is missing, of the wrong type or out of range
    "too_many_files",  # over the cap on files per directory
    "buffers",  # the buffer rows, checked when the buffer map is asked for, failed (the
    # source's metrics, from the first line, are still served)
)


class Refused(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def fail(where: str, what: str) -> Refused:
    return Refused("schema", f"{where}: {what}")


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


_ROW_INTS = (
    "slot_bytes",
    "capacity_slots",
    "tensor_bytes",
    "reserved_bytes",
    "physical_bytes",
    "mapped_bytes",
    "occupied_slots",
    "page_bytes",
)
_ROW_STRS = ("name", "family", "pool", "dtype", "account")
_row_ints = operator.itemgetter(*_ROW_INTS)
_row_strs = operator.itemgetter(*_ROW_STRS)


def _row_is_plain(d: Any) -> bool:
    """The common case, checked in one pass with C-level builtins: every field present and
    of its type, integers in [0, MAX_INT], strings short."""
    try:
        ints, strs, shape, layer = _row_ints(d), _row_strs(d), d["shape"], d["layer"]
        owner = d["owner"]
    except (KeyError, TypeError):
        return False
    return (
        set(map(type, ints)) == _INT
        and min(ints) >= 0
        and max(ints) <= MAX_INT
        and set(map(type, strs)) == _STR
        and max(map(len, strs)) <= MAX_NAME
        and type(owner) is str
        and owner in OWNERS
        and (layer is None or (type(layer) is int and 0 <= layer <= MAX_INT))
        and type(shape) is list
        and len(shape) <= MAX_DIMS
        and set(map(type, shape)) <= _INT
        and (not shape or (min(shape) >= 0 and max(shape) <= MAX_INT))
    )


_INT = {int}
_STR = {str}
_DICT = {dict}


def buffer_row(d: Any, i: int) -> BufferRow:
    if _row_is_plain(d):
        slot, cap, tensor, reserved, physical, mapped, occupied, page = _row_ints(d)
        name, family, pool, dtype, account = _row_strs(d)
        spec = BufferSpec(
            name, family, pool, Owner(d["owner"]), d["layer"], dtype, tuple(d["shape"]),
            slot, cap, tensor, reserved,
        )  # fmt: skip
        return BufferRow(spec, account, physical, mapped, occupied, page)
    where = f"buffers[{i}]"  # the slow path, to name what is wrong
    d = as_dict(d, where)
    layer = d.get("layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise fail(where, f"layer={layer!r:.60}, expected null or an integer >= 0")
    shape = as_list(get_field(d, "shape", where), f"{where}.shape", MAX_DIMS)
    if any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_INT for x in shape):
        raise fail(where, "shape: expected non-negative integers")
    spec = BufferSpec(
        name=str_of(d, "name", where),
        family=str_of(d, "family", where),
        pool=str_of(d, "pool", where),
        owner=owner_of(d, where),
        layer=layer,
        dtype=str_of(d, "dtype", where),
        shape=tuple(shape),
        slot_bytes=int_of(d, "slot_bytes", where),
        capacity_slots=int_of(d, "capacity_slots", where),
        tensor_bytes=int_of(d, "tensor_bytes", where),
        reserved_bytes=int_of(d, "reserved_bytes", where),
    )
    return BufferRow(
        spec=spec,
        account=str_of(d, "account", where),
        physical_bytes=int_of(d, "physical_bytes", where),
        mapped_bytes=int_of(d, "mapped_bytes", where),
        occupied_slots=int_of(d, "occupied_slots", where),
        page_bytes=int_of(d, "page_bytes", where),
    )


def _plain_strs(values: tuple[Any, ...], limit: int = MAX_NAME) -> bool:
    return set(map(type, values)) == _STR and max(map(len, values)) <= limit


# The integer figures of an account row: AccountRow's int fields, declared there once.
_ACCOUNT_INTS = tuple(f.name for f in dataclasses.fields(AccountRow) if f.type in ("int", int))
_account_ints = operator.itemgetter(*_ACCOUNT_INTS)
_account_rest = operator.itemgetter(
    "key",
    "family",
    "pool",
    "owner",
    "map_seconds_total",
    "unmap_seconds_total",
    "map_bucket_counts",
)
_BUCKETS = len(MAP_SECONDS_BUCKETS) + 1
_NUM = {int, float}


_ACCOUNT_KEYS = tuple(f.name for f in dataclasses.fields(AccountRow))
_ACCOUNT_KEYSET = frozenset(_ACCOUNT_KEYS)


_account_strs = operator.itemgetter("key", "family", "pool")
_account_seconds = operator.itemgetter("map_seconds_total", "unmap_seconds_total")
_account_owner = operator.itemgetter("owner")
_account_buckets = operator.itemgetter("map_bucket_counts")
_chain = itertools.chain.from_iterable


def plain_rows(rows: list[Any], keys: frozenset[str]) -> bool:
    """Every row a dict with as many keys as `keys` (the caller's itemgetters over all of
    `keys` then raise KeyError unless each row has exactly those)."""
    return set(map(type, rows)) == _DICT and set(map(len, rows)) == {len(keys)}


def plain_ints(values: list[Any]) -> bool:
    """Every value an int in [0, MAX_INT] (C-level builtins over the whole list)."""
    return not values or (
        set(map(type, values)) == _INT and min(values) >= 0 and max(values) <= MAX_INT
    )


def _plain_accounts(rows: list[Any]) -> bool:
    """The common case, every account row at once with C-level builtins: exactly the
    fields, each of its type and range. False to take the row-by-row path."""
    if not plain_rows(rows, _ACCOUNT_KEYSET):
        return False
    try:
        ints = list(_chain(map(_account_ints, rows)))
        buckets = list(map(_account_buckets, rows))
        strs = list(_chain(map(_account_strs, rows)))
        seconds = list(_chain(map(_account_seconds, rows)))
        owners = set(map(_account_owner, rows))
    except (KeyError, TypeError):  # a key missing (so another one there), or unhashable
        return False
    return (
        plain_ints(ints)
        and set(map(type, buckets)) == {list}
        and set(map(len, buckets)) == {_BUCKETS}
        and plain_ints(list(_chain(buckets)))
        and set(map(type, strs)) == _STR
        and max(map(len, strs)) <= MAX_NAME
        and owners <= OWNERS
        and set(map(type, seconds)) == {float}
        and all(map(math.isfinite, seconds))
        and min(seconds) >= 0
    )


def accounts_of(rows: list[Any]) -> list[dict[str, Any]]:
    """The account rows checked, each as `AccountRow.to_dict()` has it (exactly its fields;
    seconds as floats); `AccountRow.from_dict` of each cannot fail. In the common case the
    rows themselves."""
    if rows and _plain_accounts(rows):
        return rows
    return [account_fields(d, i) for i, d in enumerate(rows)]


def account_fields(d: Any, i: int) -> dict[str, Any]:
    """One account row checked field by field, naming the first fault."""
    where = f"accounts[{i}]"
    d = as_dict(d, where)
    buckets = as_list(get_field(d, "map_bucket_counts", where), f"{where}.map_bucket_counts", 64)
    if len(buckets) != _BUCKETS or any(
        isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_INT for c in buckets
    ):
        raise fail(where, f"map_bucket_counts: expected {_BUCKETS} non-negative integers")
    return {
        "key": str_of(d, "key", where),
        "family": str_of(d, "family", where),
        "pool": str_of(d, "pool", where),
        "owner": owner_of(d, where).value,
        **{k: int_of(d, k, where) for k in _ACCOUNT_INTS},
        "map_seconds_total": num_of(d, "map_seconds_total", where),
        "unmap_seconds_total": num_of(d, "unmap_seconds_total", where),
        "map_bucket_counts": list(buckets),
    }


def reconciliation_entry(d: Any, i: int) -> dict[str, Any]:
    where = f"reconciliation[{i}]"
    d = as_dict(d, where)
    device = opt_int_of(d, "device_bytes", where)
    ledger = opt_int_of(d, "ledger_bytes", where)
    available = d.get("available", False)
    if not isinstance(available, bool):
        raise fail(where, "available: expected true or false")
    detail = scalars_of(d.get("detail") or {}, f"{where}.detail")
    return {
        "source": str_of(d, "source", where) if "source" in d else "unknown",
        "basis": str_of(d, "basis", where) if "basis" in d else "",
        "available": available and device is not None,
        "reason": str_of(d, "reason", where, MAX_TEXT) if "reason" in d else "",
        "device_bytes": device,
        "ledger_bytes": ledger,
        "unattributed_bytes": device - ledger
        if device is not None and ledger is not None
        else None,
        "detail": detail,
    }


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


def tp_status(d: Any) -> TpStatus | None:
    if d is None:
        return None
    d = as_dict(d, "tp")
    ints = {k: int_of(d, k, "tp") for k in ("rank", "size", *TP_COUNTERS)}
    try:
        return TpStatus(last_error=str_of(d, "last_error", "tp", MAX_TEXT), **ints)
    except ValueError as e:
        raise fail("tp", str(e)) from None
