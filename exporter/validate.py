"""The one schema a published snapshot file must meet before the exporter believes it.

`load(data, name, now)` parses a file written by `accounting.publisher` and returns
its envelope and a `Snapshot` rebuilt from the rows, or raises `Refused` with a
reason from `REASONS` and a one-line detail. What is checked:
- the envelope: schema version, `source` equal to the file's name, pid, host,
  process start, `interval` within [MIN_INTERVAL_S, MAX_INTERVAL_S], a finite
  heartbeat no more than MAX_SKEW_S in the future, a sequence number;
- every buffer and account row: types, finite and non-negative figures, names of
  bounded length, bucket counts of the right length; labels as short strings;
- reconciliation entries (`unattributed_bytes` recomputed as device - ledger) and the
  TP status.
What is recomputed, never taken from the file: the totals, the per-family rollups,
`occupied_bytes` and the relation violations (`Snapshot.build` over the rows).
JSON nested deeper than the parser allows is refused as "nesting"; anything nested
deeper than the schema is a "schema" refusal.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.publisher import ENVELOPE_SCHEMA, SUFFIX, check_interval
from accounting.snapshot import SCHEMA_VERSION, AccountRow, BufferRow, Snapshot
from accounting.tp_status import TpStatus

MAX_SKEW_S = 5.0  # how far in the future a heartbeat or snapshot time may be (clock skew)
MAX_NAME = 256  # characters in a name, label or dtype
MAX_TEXT = 4096  # characters in a free-text field (reasons, errors)
MAX_LABELS = 32
MAX_ROWS = 100_000  # buffers or accounts in one snapshot
MAX_DIMS = 8
MAX_INT = 2**63 - 1
_OWNERS = frozenset(o.value for o in Owner)

# Why a file is not served: a small fixed set, so a metric labelled by it stays bounded.
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
)


class Refused(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def _fail(where: str, what: str) -> Refused:
    return Refused("schema", f"{where}: {what}")


def _dict(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _fail(where, f"expected an object, got {type(d).__name__}")
    return d


def _list(d: Any, where: str, limit: int = MAX_ROWS) -> list[Any]:
    if not isinstance(d, list):
        raise _fail(where, f"expected a list, got {type(d).__name__}")
    if len(d) > limit:
        raise _fail(where, f"{len(d)} entries, expected at most {limit}")
    return d


def _get(d: dict[str, Any], key: str, where: str) -> Any:
    try:
        return d[key]
    except KeyError:
        raise _fail(where, f"missing {key!r}") from None


def _int(d: dict[str, Any], key: str, where: str, *, lo: int = 0) -> int:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_INT:
        raise _fail(where, f"{key}={v!r:.60}, expected an integer >= {lo}")
    return v


def _opt_int(d: dict[str, Any], key: str, where: str, *, lo: int = 0) -> int | None:
    return None if d.get(key) is None else _int(d, key, where, lo=lo)


def _num(d: dict[str, Any], key: str, where: str) -> float:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _fail(where, f"{key}={v!r:.60}, expected a finite number >= 0")
    return float(v)


def _str(d: dict[str, Any], key: str, where: str, limit: int = MAX_NAME) -> str:
    v = _get(d, key, where)
    if not isinstance(v, str) or len(v) > limit:
        raise _fail(where, f"{key}: expected a string of at most {limit} characters")
    return v


def _owner(d: dict[str, Any], where: str) -> Owner:
    v = _get(d, "owner", where)
    if v not in _OWNERS:
        raise _fail(where, f"owner={v!r:.60}, expected one of {sorted(_OWNERS)}")
    return Owner(v)


def _labels(d: Any) -> dict[str, str]:
    labels = _dict(d, "labels")
    if len(labels) > MAX_LABELS:
        raise _fail("labels", f"{len(labels)} labels, expected at most {MAX_LABELS}")
    for k, v in labels.items():
        if not isinstance(v, str) or len(k) > MAX_NAME or len(v) > MAX_NAME:
            raise _fail("labels", f"{k!r:.60}: expected short string keys and values")
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
    except (KeyError, TypeError):
        return False
    return (
        set(map(type, ints)) == _INT
        and min(ints) >= 0
        and max(ints) <= MAX_INT
        and set(map(type, strs)) == _STR
        and max(map(len, strs)) <= MAX_NAME
        and d["owner"] in _OWNERS
        and (layer is None or (type(layer) is int and 0 <= layer <= MAX_INT))
        and type(shape) is list
        and len(shape) <= MAX_DIMS
        and set(map(type, shape)) <= _INT
        and (not shape or (min(shape) >= 0 and max(shape) <= MAX_INT))
    )


_INT = {int}
_STR = {str}


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
    d = _dict(d, where)
    layer = d.get("layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise _fail(where, f"layer={layer!r:.60}, expected null or an integer >= 0")
    shape = _list(_get(d, "shape", where), f"{where}.shape", MAX_DIMS)
    if any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_INT for x in shape):
        raise _fail(where, "shape: expected non-negative integers")
    spec = BufferSpec(
        name=_str(d, "name", where),
        family=_str(d, "family", where),
        pool=_str(d, "pool", where),
        owner=_owner(d, where),
        layer=layer,
        dtype=_str(d, "dtype", where),
        shape=tuple(shape),
        slot_bytes=_int(d, "slot_bytes", where),
        capacity_slots=_int(d, "capacity_slots", where),
        tensor_bytes=_int(d, "tensor_bytes", where),
        reserved_bytes=_int(d, "reserved_bytes", where),
    )
    return BufferRow(
        spec=spec,
        account=_str(d, "account", where),
        physical_bytes=_int(d, "physical_bytes", where),
        mapped_bytes=_int(d, "mapped_bytes", where),
        occupied_slots=_int(d, "occupied_slots", where),
        page_bytes=_int(d, "page_bytes", where),
    )


def account_row(d: Any, i: int) -> AccountRow:
    where = f"accounts[{i}]"
    d = _dict(d, where)
    buckets = _list(_get(d, "map_bucket_counts", where), f"{where}.map_bucket_counts", 64)
    if len(buckets) != len(MAP_SECONDS_BUCKETS) + 1 or any(
        isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_INT for c in buckets
    ):
        raise _fail(
            where,
            f"map_bucket_counts: expected {len(MAP_SECONDS_BUCKETS) + 1} non-negative integers",
        )
    ints = {
        k: _int(d, k, where)
        for k in (
            "page_bytes",
            "capacity_slots",
            "occupied_slots",
            "peak_occupied_slots",
            "handle_pages",
            "peak_handle_pages",
            "mapped_pages",
            "pages_mapped_total",
            "pages_unmapped_total",
            "map_calls",
        )
    }
    return AccountRow(
        key=_str(d, "key", where),
        family=_str(d, "family", where),
        pool=_str(d, "pool", where),
        owner=_owner(d, where),
        map_seconds_total=_num(d, "map_seconds_total", where),
        unmap_seconds_total=_num(d, "unmap_seconds_total", where),
        map_bucket_counts=tuple(buckets),
        **ints,
    )


def reconciliation_entry(d: Any, i: int) -> dict[str, Any]:
    where = f"reconciliation[{i}]"
    d = _dict(d, where)
    device = _opt_int(d, "device_bytes", where)
    ledger = _opt_int(d, "ledger_bytes", where)
    available = d.get("available", False)
    if not isinstance(available, bool):
        raise _fail(where, "available: expected true or false")
    detail = _scalars(d.get("detail") or {}, f"{where}.detail")
    return {
        "source": _str(d, "source", where) if "source" in d else "unknown",
        "basis": _str(d, "basis", where) if "basis" in d else "",
        "available": available and device is not None,
        "reason": _str(d, "reason", where, MAX_TEXT) if "reason" in d else "",
        "device_bytes": device,
        "ledger_bytes": ledger,
        "unattributed_bytes": device - ledger
        if device is not None and ledger is not None
        else None,
        "detail": detail,
    }


def _scalars(d: Any, where: str) -> dict[str, Any]:
    """A flat object of short strings, finite numbers, booleans and nulls."""
    d = _dict(d, where)
    if len(d) > MAX_LABELS:
        raise _fail(where, f"{len(d)} entries, expected at most {MAX_LABELS}")
    for k, v in d.items():
        ok = v is None or isinstance(v, (bool, int)) or (isinstance(v, str) and len(v) <= MAX_TEXT)
        ok = ok or (isinstance(v, float) and math.isfinite(v))
        if not ok or len(k) > MAX_NAME:
            raise _fail(where, f"{k!r:.60}: expected a string, finite number, boolean or null")
    return dict(d)


def _tp(d: Any) -> TpStatus | None:
    if d is None:
        return None
    d = _dict(d, "tp")
    ints = {
        k: _int(d, k, "tp")
        for k in (
            "rank",
            "size",
            "exchanges_total",
            "page_ops_total",
            "divergences_total",
            "peer_failures_total",
        )
    }
    try:
        return TpStatus(last_error=_str(d, "last_error", "tp", MAX_TEXT), **ints)
    except ValueError as e:
        raise _fail("tp", str(e)) from None


def _parse(data: bytes) -> tuple[dict[str, Any], Any]:
    head, sep, rows = data.partition(b"\n")
    if not sep:
        raise Refused("parse", "one line; expected the envelope, a newline, the buffer rows")
    try:
        return _dict(json.loads(head), "envelope"), json.loads(rows)
    except RecursionError:
        raise Refused("nesting", "JSON nested deeper than the parser allows") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused("parse", f"not JSON: {e}") from None


def load(data: bytes, name: str, now: float) -> tuple[dict[str, Any], Snapshot]:
    """(envelope without the snapshot, Snapshot rebuilt and checked) of file `name`'s bytes."""
    env, rows = _parse(data)
    if env.get("kvledger_publish") != ENVELOPE_SCHEMA:
        raise _fail(
            "envelope",
            f"kvledger_publish={env.get('kvledger_publish')!r:.60}, expected {ENVELOPE_SCHEMA}",
        )
    source = _str(env, "source", "envelope")
    if source + SUFFIX != name:
        raise _fail("envelope", f"source={source!r:.60} does not match the file name {name!r}")
    try:
        interval = check_interval(_get(env, "interval", "envelope"), "interval")
    except ValueError as e:
        raise _fail("envelope", str(e)) from None
    published_at = _num(env, "published_at", "envelope")
    if published_at > now + MAX_SKEW_S:
        raise _fail("envelope", f"published_at is {published_at - now:.0f} s in the future")
    host = env.get("host")
    if host is not None and (not isinstance(host, str) or len(host) > MAX_NAME):
        raise _fail("envelope", "host: expected a short string or null")
    envelope = {
        "source": source,
        "pid": _opt_int(env, "pid", "envelope", lo=1),
        "host": host,
        "process_start": _opt_int(env, "process_start", "envelope"),
        "interval": interval,
        "published_at": published_at,
        "sequence": _int(env, "sequence", "envelope"),
    }
    snap = _dict(_get(env, "snapshot", "envelope"), "snapshot")
    if snap.get("schema") != SCHEMA_VERSION:
        raise _fail("snapshot", f"schema={snap.get('schema')!r:.60}, expected {SCHEMA_VERSION}")
    taken_at = _num(snap, "taken_at", "snapshot")
    if taken_at > now + MAX_SKEW_S:
        raise _fail("snapshot", f"taken_at is {taken_at - now:.0f} s in the future")
    reconciliation = [
        reconciliation_entry(r, i)
        for i, r in enumerate(_list(snap.get("reconciliation") or [], "reconciliation", 16))
    ]
    built = Snapshot.build(
        epoch=_int(snap, "epoch", "snapshot"),
        taken_at=taken_at,
        labels=_labels(_get(snap, "labels", "snapshot")),
        accounts=[
            account_row(a, i)
            for i, a in enumerate(_list(_get(snap, "accounts", "snapshot"), "accounts"))
        ],
        buffers=[buffer_row(b, i) for i, b in enumerate(_list(rows, "buffers"))],
        tp=_tp(snap.get("tp")),
    )
    return envelope, built.with_reconciliation(reconciliation)
