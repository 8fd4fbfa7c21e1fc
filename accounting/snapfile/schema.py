"""The schema of a snapshot file: every JSON value and every part of it checked and typed.

Parts: the buffer rows, account rows, per-family rows, violations, reconciliation
entries, the TP status, the labels. A checker takes the parsed JSON of one part and
returns accounting's record of it (`BufferRow`, `AccountRow`, `FamilyRow`,
`Violation`, `Reconciliation`, `TpStatus`), or raises `Refused` ("schema") naming the
row, the field, the value (cut to 60 characters) and what was expected: finite,
non-negative figures, integers within 64 bits, names of bounded length, lists of
bounded size. The fields a row must have are read from its dataclass, so a field
added there is checked here. The common case, every row well formed, is checked a
whole list at a time with C-level builtins (`plain_*`); a list that fails it is checked
row by row to name the first fault. `parse_json` (orjson, with the standard library
deciding what orjson refuses) refuses bytes that are not JSON ("parse") or nested deeper
than the parser allows ("nesting").

The first line's accounts and families come as columns (`accounting.snapfile.format`):
`account_table` and `family_table` check every field's type and range (an account has
exactly AccountRow's fields: integers in [0, MAX_INT], short strings, an owner of
`Owner`, finite non-negative seconds, `len(MAP_SECONDS_BUCKETS) + 1` bucket counts; a
family row its name, owner and every figure) with a few C-level passes over whole
columns, and hand a table that fails them to the row checkers (`account_fields`,
`family_row`), which name the first fault, so a refusal reads as it did for rows:
"accounts[3]: mapped_pages=-1, expected an integer >= 0". A table is returned as checked
columns, owners as their values (`accounting.snapfile.summary`).

Whether the parts agree with each other is `accounting.snapfile.checks`' business.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import operator
from typing import Any

import orjson

from accounting.buffers import BufferSpec, Owner
from accounting.engine_state import (
    MAX_NOTE,
    MAX_NOTES,
    MAX_REQUESTS,
    MAX_RID,
    REQUEST_BYTES_BUCKETS,
    EngineState,
    RequestHeld,
)
from accounting.figures import FIGURE_NAMES, Figures
from accounting.gpu_parts import PART_NAMES
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.relations import Violation
from accounting.rows import AccountRow, BufferRow
from accounting.snapfile.format import (
    ACCOUNT_FIELDS,
    FAMILY_FIELDS,
    MAX_SOURCE_BYTES,
    Columns,
    Refused,
    columns_of,
    fail,
    rows_of,
    table_of,
)
from accounting.snapfile.summary import FamilyRow, Reconciliation, family_columns
from accounting.tp_status import TpStatus

MAX_NAME = 256  # characters in a name, label or dtype
MAX_TEXT = 4096  # characters in a free-text field (reasons, errors)
MAX_LABELS = 32
MAX_ROWS = 100_000  # buffers or accounts in one snapshot
MAX_DIMS = 8
MAX_INT = 2**63 - 1
OWNERS = frozenset(o.value for o in Owner)

INT = {int}
STR = {str}


def parse_json(data: bytes) -> Any:
    """`data` parsed. orjson, a parser in native code, reads a first line about 4x faster
    than the standard library (parsing is the largest single cost of reading a new file
    version). It is stricter: where it refuses, the standard library reads the bytes again,
    so that a NaN, an Infinity or a lone surrogate reaches the schema, which names the field,
    and every refusal reads as it always has. The one difference left: an integer beyond 64
    bits comes back as a float, which every integer field refuses by name."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass  # the standard library decides (and names the fault)
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
def plain_ints(values: list[Any]) -> bool:
    """Every value an int in [0, MAX_INT] (C-level builtins over the whole list)."""
    return not values or (
        set(map(type, values)) == INT and min(values) >= 0 and max(values) <= MAX_INT
    )


def plain_strs(values: list[Any], limit: int = MAX_NAME) -> bool:
    """Every value a string of at most `limit` characters."""
    return not values or (set(map(type, values)) == STR and max(map(len, values)) <= limit)


# -- the parts of a snapshot ------------------------------------------------------------------
MAX_FAMILIES = 64  # rows of the per-family rollup (DeepSeek-V4 has 7; 4,096 is a lie)
MAX_TRUTHS = 16  # reconciliation entries


def _int_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.type in ("int", int))


# -- buffer rows (the second line) ------------------------------------------------------------
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
        set(map(type, ints)) == INT
        and min(ints) >= 0
        and max(ints) <= MAX_INT
        and set(map(type, strs)) == STR
        and max(map(len, strs)) <= MAX_NAME
        and type(owner) is str
        and owner in OWNERS
        and (layer is None or (type(layer) is int and 0 <= layer <= MAX_INT))
        and type(shape) is list
        and len(shape) <= MAX_DIMS
        and set(map(type, shape)) <= INT
        and (not shape or (min(shape) >= 0 and max(shape) <= MAX_INT))
    )


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


# -- account rows and per-family rows (read as columns: `account_table`, `family_table`) ------
# The integer figures of an account row: AccountRow's int fields, declared there once.
ACCOUNT_INTS = _int_fields(AccountRow)
BUCKETS = len(MAP_SECONDS_BUCKETS) + 1  # an account's map_bucket_counts


def account_fields(d: Any, i: int) -> dict[str, Any]:
    """One account row checked field by field, naming the first fault; as
    `AccountRow.to_dict()` writes it (other keys dropped)."""
    where = f"accounts[{i}]"
    d = as_dict(d, where)
    buckets = as_list(get_field(d, "map_bucket_counts", where), f"{where}.map_bucket_counts", 64)
    if len(buckets) != BUCKETS or any(
        isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_INT for c in buckets
    ):
        raise fail(where, f"map_bucket_counts: expected {BUCKETS} non-negative integers")
    return {
        "key": str_of(d, "key", where),
        "family": str_of(d, "family", where),
        "pool": str_of(d, "pool", where),
        "owner": owner_of(d, where).value,
        **{k: int_of(d, k, where) for k in ACCOUNT_INTS},
        "map_seconds_total": num_of(d, "map_seconds_total", where),
        "unmap_seconds_total": num_of(d, "unmap_seconds_total", where),
        "map_bucket_counts": list(buckets),
    }


def family_row(row: Any, i: int) -> FamilyRow:
    """One per-family row checked field by field, naming the first fault."""
    where = f"families[{i}]"
    row = as_dict(row, where)
    return FamilyRow(
        family=str_of(row, "family", where),
        owner=owner_of(row, where),
        figures=Figures(*(int_of(row, name, where) for name in FIGURE_NAMES)),
    )


# -- the account and family columns, a whole column at a time ------------------------------
_chain = itertools.chain.from_iterable
FLOAT = {float}
LIST = {list}


def _plain_accounts(t: Columns) -> bool:
    """Every account value of its type and range, told column by column with C-level
    builtins. False to take the row-by-row path."""
    if not t["key"]:
        return True
    buckets = t["map_bucket_counts"]
    seconds = t["map_seconds_total"] + t["unmap_seconds_total"]
    try:
        owners = set(t["owner"])
    except TypeError:  # unhashable
        return False
    return (
        plain_ints(list(_chain(map(t.__getitem__, ACCOUNT_INTS))))
        and set(map(type, buckets)) == LIST
        and set(map(len, buckets)) == {BUCKETS}
        and plain_ints(list(_chain(buckets)))
        and plain_strs(t["key"] + t["family"] + t["pool"])
        and owners <= OWNERS
        and set(map(type, seconds)) == FLOAT
        and all(map(math.isfinite, seconds))
        and min(seconds) >= 0
    )


def account_table(d: Any) -> Columns:
    """The account columns, checked: exactly AccountRow's fields (seconds as floats)."""
    table = table_of(d, "accounts", ACCOUNT_FIELDS, MAX_ROWS)
    if _plain_accounts(table):
        return table
    rows = rows_of(table, ACCOUNT_FIELDS)
    return columns_of((account_fields(row, i) for i, row in enumerate(rows)), ACCOUNT_FIELDS)


def _plain_families(t: Columns) -> bool:
    """Every family value of its type and range (C-level passes); False to take the
    row-by-row path."""
    if not t["family"]:
        return True
    try:
        owners = set(t["owner"])
    except TypeError:  # unhashable
        return False
    return (
        plain_strs(t["family"])
        and owners <= OWNERS
        and plain_ints(list(_chain(map(t.__getitem__, FIGURE_NAMES))))
    )


def family_table(d: Any) -> Columns:
    """The per-family columns as listed, checked (their sums: `accounting.snapfile.checks`)."""
    table = table_of(d, "families", FAMILY_FIELDS, MAX_FAMILIES)
    if _plain_families(table):
        return table
    rows = rows_of(table, FAMILY_FIELDS)
    return family_columns(family_row(row, i) for i, row in enumerate(rows))


# -- violations, reconciliation, TP status -----------------------------------------------------
def violations_of(d: Any) -> list[Violation]:
    """The listed violations, each checked (whether the list is complete: `checks`)."""
    out = []
    for i, v in enumerate(as_list(d, "violations")):
        where = f"violations[{i}]"
        v = as_dict(v, where)
        out.append(
            Violation(
                subject=str_of(v, "subject", where, 2 * MAX_NAME + 1),
                relation=str_of(v, "relation", where),
                detail=str_of(v, "detail", where, MAX_TEXT),
            )
        )
    return out


def reconciliation_of(d: Any) -> tuple[Reconciliation, ...]:
    return tuple(
        reconciliation_entry(r, i)
        for i, r in enumerate(as_list(d or [], "reconciliation", MAX_TRUTHS))
    )


def bytes_of(d: dict[str, Any], key: str, where: str) -> int | None:
    """An optional byte figure: an integer in [0, MAX_SOURCE_BYTES] (more than one source
    can hold is not believed: a ledger of 9.2e18 bytes would make unattributed -9.2e18)."""
    v = opt_int_of(d, key, where)
    if v is not None and v > MAX_SOURCE_BYTES:
        raise fail(
            where, f"{key}={v}, over the {MAX_SOURCE_BYTES} one source can hold; not believed"
        )
    return v


def reconciliation_entry(d: Any, i: int) -> Reconciliation:
    where = f"reconciliation[{i}]"
    d = as_dict(d, where)
    device = bytes_of(d, "device_bytes", where)
    ledger = bytes_of(d, "ledger_bytes", where)
    available = d.get("available", False)
    if not isinstance(available, bool):
        raise fail(where, "available: expected true or false")
    checked: dict[str, Any] = {
        "device_bytes": device,
        "ledger_bytes": ledger,
        "available": available,
        "detail": scalars_of(d.get("detail") or {}, f"{where}.detail"),
    }
    for key, limit in (
        ("source", MAX_NAME),
        ("basis", MAX_NAME),
        ("reason", MAX_TEXT),
        ("uuid", MAX_NAME),
        ("gpu", MAX_NAME),
    ):
        if key in d:
            checked[key] = str_of(d, key, where, limit)
    checked["total_bytes"] = bytes_of(d, "total_bytes", where)
    checked["parts"] = gpu_parts_of(d.get("parts") or {}, f"{where}.parts")
    return Reconciliation.of(checked)


def gpu_parts_of(d: Any, where: str) -> dict[str, int]:
    """The GPU parts of a reconciliation entry: every name one of `accounting.gpu_parts`'s,
    every value an int of at most MAX_SOURCE_BYTES either way (`unattributed` may be
    negative; a negative other part, or one past the device's total, is listed as a
    violation, not refused: `accounting.gpu_parts.check_parts`)."""
    d = as_dict(d, where)
    out: dict[str, int] = {}
    for name, value in d.items():
        if name not in PART_NAMES:
            raise fail(where, f"{str(name)[:40]!r}: expected one of {', '.join(PART_NAMES)}")
        if type(value) is not int:
            raise fail(where, f"{name}: expected an integer number of bytes")
        if abs(value) > MAX_SOURCE_BYTES:
            raise fail(
                where,
                f"{name}={value}, over the {MAX_SOURCE_BYTES} bytes one source can hold "
                "either way; not believed",
            )
        out[name] = value
    return out


_TP_INTS = _int_fields(TpStatus)


def tp_status(d: Any) -> TpStatus | None:
    if d is None:
        return None
    d = as_dict(d, "tp")
    ints = {k: int_of(d, k, "tp") for k in _TP_INTS}
    try:
        return TpStatus(last_error=str_of(d, "last_error", "tp", MAX_TEXT), **ints)
    except ValueError as e:
        raise fail("tp", str(e)) from None


# -- engine state (accounting.engine_state) ---------------------------------------------------
def engine_state_of(d: Any) -> EngineState | None:
    """The engine's holder notes, retractions and per-request footprints, checked: bounded
    lists, short strings, non-negative figures, the histogram's counts adding up to the
    running requests."""
    if d is None:
        return None
    where = "engine"
    d = as_dict(d, where)
    notes = as_list(d.get("notes") or [], f"{where}.notes", MAX_NOTES)
    if not plain_strs(notes, MAX_NOTE):
        raise fail(where, f"notes: expected strings of at most {MAX_NOTE} characters")
    counts = as_list(get_field(d, "request_bytes_counts", where), f"{where}.request_bytes_counts")
    if len(counts) != len(REQUEST_BYTES_BUCKETS) + 1 or not plain_ints(counts):
        raise fail(
            where,
            f"request_bytes_counts: expected {len(REQUEST_BYTES_BUCKETS) + 1} non-negative "
            "integers",
        )
    running = int_of(d, "running_requests", where)
    if sum(counts) != running:
        raise fail(where, f"request_bytes_counts sum to {sum(counts)}, running_requests={running}")
    requests = []
    for i, r in enumerate(as_list(d.get("requests") or [], f"{where}.requests", MAX_REQUESTS)):
        at = f"{where}.requests[{i}]"
        r = as_dict(r, at)
        by_family = as_dict(r.get("bytes_by_family") or {}, f"{at}.bytes_by_family")
        if len(by_family) > MAX_FAMILIES or not plain_strs(list(by_family)):
            raise fail(at, "bytes_by_family: expected short family names")
        if not plain_ints(list(by_family.values())):
            raise fail(at, "bytes_by_family: expected non-negative integers")
        requests.append(
            RequestHeld(
                rid=str_of(r, "rid", at, MAX_RID),
                tokens=int_of(r, "tokens", at),
                age_seconds=num_of(r, "age_seconds", at),
                bytes=int_of(r, "bytes", at),
                bytes_by_family=dict(by_family),
            )
        )
    if len(requests) > running:
        raise fail(where, f"{len(requests)} requests listed, running_requests={running}")
    total = int_of(d, "request_bytes_sum", where)
    _requests_agree(requests, running, total, counts)
    return EngineState(
        holders_from=str_of(d, "holders_from", where),
        notes=tuple(notes),
        retracted_requests_total=int_of(d, "retracted_requests_total", where),
        running_requests=running,
        request_bytes_sum=total,
        request_bytes_counts=tuple(counts),
        requests=tuple(requests),
    )


def _requests_agree(
    requests: list[RequestHeld], running: int, total: int, counts: list[int]
) -> None:
    """The engine's figures are one set of rows told three ways (the listed requests, the
    histogram, the sum: `accounting.engine_state.RequestBytes`), so they must agree exactly:
    a request's `bytes_by_family` (when given) sum to its bytes; every byte figure at most
    what one source can hold; the listed requests fall in buckets the histogram counts;
    `request_bytes_sum` is the listed requests' sum when every running request is listed
    (at least it otherwise), and within what the histogram's buckets allow."""
    where = "engine"
    for i, r in enumerate(requests):
        at = f"{where}.requests[{i}]"
        if r.bytes > MAX_SOURCE_BYTES:
            raise fail(at, f"bytes={r.bytes}, over the {MAX_SOURCE_BYTES} one source can hold")
        split = sum(r.bytes_by_family.values())
        if r.bytes_by_family and split != r.bytes:
            raise fail(at, f"bytes_by_family sum to {split}, bytes={r.bytes}")
    if total > MAX_SOURCE_BYTES:
        raise fail(
            where, f"request_bytes_sum={total}, over the {MAX_SOURCE_BYTES} one source can hold"
        )
    listed = sum(r.bytes for r in requests)
    if len(requests) == running and total != listed:
        raise fail(
            where,
            f"request_bytes_sum={total}, but the {running} running requests, every one "
            f"listed, sum to {listed}",
        )
    if total < listed:
        raise fail(where, f"request_bytes_sum={total}, less than the listed requests' {listed}")
    bounds = REQUEST_BYTES_BUCKETS
    in_bucket = [0] * len(counts)
    for r in requests:
        in_bucket[bisect.bisect_left(bounds, r.bytes)] += 1
    for i, (n, have) in enumerate(zip(in_bucket, counts, strict=True)):
        if n > have:
            le = f"<= {bounds[i]}" if i < len(bounds) else f"> {bounds[-1]}"
            raise fail(
                where,
                f"{n} listed requests hold {le} bytes, request_bytes_counts[{i}]={have}",
            )
    lo = sum(n * (bounds[i - 1] + 1) for i, n in enumerate(counts) if i and n)
    hi = sum(n * bounds[i] for i, n in enumerate(counts[:-1]))
    if total < lo or (not counts[-1] and total > hi):
        raise fail(
            where,
            f"request_bytes_sum={total}, outside what request_bytes_counts allow "
            f"([{lo}, {hi if not counts[-1] else 'unbounded'}])",
        )
