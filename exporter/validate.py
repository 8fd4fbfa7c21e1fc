"""What the exporter believes of a published snapshot file, and when it checks it.

A file (`accounting.publisher`) is two lines: an envelope carrying everything a scrape
reads (totals, per-family rollups, accounts, relation violations, reconciliation, TP
status), then the buffer rows. The two are checked at different times:

- `load(data, name, now)`, when a new version of the file is read: parses and checks
  the first line only (O(families + accounts), never O(buffers)), and returns a `Head`
  whose `summary` is what `/metrics` exports. Checked: the envelope (schema version,
  `source` equal to the file's name, pid, host, process start, `interval` within
  [MIN_INTERVAL_S, MAX_INTERVAL_S], a finite heartbeat no more than MAX_SKEW_S in the
  future, a sequence number); every account, family row, violation and reconciliation
  entry (types, finite and non-negative figures, bounded names and sizes: `exporter.
  schema`). Recomputed from the first line rather than taken from it: each family's slot
  figures (the sum of its accounts), the totals (the sum of the families), the accounts'
  relation violations and `unattributed_bytes`; a file whose own figures disagree is
  refused. A family whose summed figures break a relation (e.g. mapped > physical) must
  list a violation of that relation, or the file is refused.
- `buffer_map(head)`, when someone asks for the buffer map (`/debug/kv`): parses and
  checks the buffer rows, rebuilds the Snapshot from them (rollups and violations
  recomputed from the rows) and requires it to agree with the first line. A failure is
  `Refused("buffers", ...)`: that source's buffer map is not shown, its metrics are.

JSON nested deeper than the parser allows is refused as "nesting"; anything nested
deeper than the schema is a "schema" refusal.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

from accounting.buffers import Owner
from accounting.figures import FIGURE_NAMES
from accounting.publisher import ENVELOPE_SCHEMA, SUFFIX, check_interval
from accounting.relations import check_account
from accounting.snapshot import SCHEMA_VERSION, AccountRow, Snapshot
from accounting.tp_status import TpStatus
from exporter.schema import (
    MAX_NAME,
    MAX_TEXT,
    OWNERS,
    REASONS,
    Refused,
    accounts_of,
    as_dict,
    as_list,
    buffer_row,
    fail,
    get_field,
    int_of,
    labels_of,
    num_of,
    opt_int_of,
    owner_of,
    plain_ints,
    plain_rows,
    reconciliation_entry,
    str_of,
    tp_status,
)
from exporter.summary import summary_of, totals_of

__all__ = ["MAX_SKEW_S", "REASONS", "Head", "Refused", "account_may_break", "buffer_map", "load"]

MAX_SKEW_S = 5.0  # how far in the future a heartbeat or snapshot time may be (clock skew)
MAX_FAMILIES = 4096  # rows of the per-family rollup
_figures = operator.itemgetter(*FIGURE_NAMES)
_FAMILY_KEYS = frozenset(("family", "owner", *FIGURE_NAMES))
_STR = {str}


@dataclass(frozen=True)
class Head:
    """A file's first line, checked: all a scrape reads, and what the buffer rows are
    held against when someone asks for them (`buffer_map`)."""

    envelope: dict[str, Any]  # source, pid, host, process_start, interval, published_at, sequence
    summary: dict[str, Any]  # `exporter.summary.summary_of`'s shape
    tp: TpStatus | None
    rows: bytes  # the second line, unparsed


def load(data: bytes, name: str, now: float) -> Head:
    """The checked first line of file `name`'s bytes; the buffer rows are kept unparsed."""
    head, sep, rows = data.partition(b"\n")
    if not sep:
        raise Refused("parse", "one line; expected the envelope, a newline, the buffer rows")
    env = as_dict(_json(head), "envelope")
    if env.get("kvledger_publish") != ENVELOPE_SCHEMA:
        raise fail(
            "envelope",
            f"kvledger_publish={env.get('kvledger_publish')!r:.60}, expected {ENVELOPE_SCHEMA}",
        )
    source = str_of(env, "source", "envelope")
    if source + SUFFIX != name:
        raise fail("envelope", f"source={source!r:.60} does not match the file name {name!r}")
    try:
        interval = check_interval(get_field(env, "interval", "envelope"), "interval")
    except ValueError as e:
        raise fail("envelope", str(e)) from None
    published_at = num_of(env, "published_at", "envelope")
    if published_at > now + MAX_SKEW_S:
        raise fail("envelope", f"published_at is {published_at - now:.0f} s in the future")
    host = env.get("host")
    if host is not None and (not isinstance(host, str) or len(host) > MAX_NAME):
        raise fail("envelope", "host: expected a short string or null")
    envelope = {
        "source": source,
        "pid": opt_int_of(env, "pid", "envelope", lo=1),
        "host": host,
        "process_start": opt_int_of(env, "process_start", "envelope"),
        "interval": interval,
        "published_at": published_at,
        "sequence": int_of(env, "sequence", "envelope"),
    }
    snap = as_dict(get_field(env, "snapshot", "envelope"), "snapshot")
    if snap.get("schema") != SCHEMA_VERSION:
        raise fail("snapshot", f"schema={snap.get('schema')!r:.60}, expected {SCHEMA_VERSION}")
    taken_at = num_of(snap, "taken_at", "snapshot")
    if taken_at > now + MAX_SKEW_S:
        raise fail("snapshot", f"taken_at is {taken_at - now:.0f} s in the future")
    accounts = accounts_of(as_list(get_field(snap, "accounts", "snapshot"), "accounts"))
    if len({a["key"] for a in accounts}) < len(accounts):
        key = Counter(a["key"] for a in accounts).most_common(1)[0][0]
        raise fail("accounts", f"key {key!r:.60} listed twice")
    families = _families(get_field(snap, "families", "snapshot"), accounts)
    totals = totals_of(families)
    claimed = as_dict(get_field(snap, "totals", "snapshot"), "totals")
    for figure in FIGURE_NAMES:
        if claimed.get(figure) != totals[figure]:
            raise fail(
                "totals",
                f"{figure}={claimed.get(figure)!r:.60}, but the families sum to {totals[figure]}",
            )
    tp = tp_status(snap.get("tp"))
    summary = {
        "schema": SCHEMA_VERSION,
        "epoch": int_of(snap, "epoch", "snapshot"),
        "taken_at": taken_at,
        "labels": labels_of(get_field(snap, "labels", "snapshot")),
        "totals": totals,
        "families": families,
        "accounts": accounts,
        "violations": _violations(get_field(snap, "violations", "snapshot"), accounts, families),
        "reconciliation": [
            reconciliation_entry(r, i)
            for i, r in enumerate(as_list(snap.get("reconciliation") or [], "reconciliation", 16))
        ],
        "tp": tp.to_dict() if tp is not None else None,
    }
    return Head(envelope, summary, tp, rows)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise Refused("nesting", "JSON nested deeper than the parser allows") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused("parse", f"not JSON: {e}") from None


def _families(d: Any, accounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-family rows, sorted by (family, owner); each family's slot figures must be
    the sum of its accounts' (slots are counted per index space, bytes per buffer)."""
    slots: dict[tuple[str, str], list[int]] = {}
    for a in accounts:
        s = slots.setdefault((a["family"], a["owner"]), [0, 0])
        s[0] += a["occupied_slots"]
        s[1] += a["capacity_slots"]
    rows = as_list(d, "families", MAX_FAMILIES)
    if not _plain_families(rows):
        rows = [_family(row, i) for i, row in enumerate(rows)]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for i, figs in enumerate(rows):
        key = (figs["family"], figs["owner"])
        if key in out:
            raise fail(f"families[{i}]", f"{key[0]}/{key[1]} listed twice")
        occupied, capacity = slots.get(key, (0, 0))
        if (figs["occupied_slots"], figs["capacity_slots"]) != (occupied, capacity):
            raise fail(
                f"families[{i}]",
                f"occupied_slots={figs['occupied_slots']} capacity_slots="
                f"{figs['capacity_slots']}, but the accounts of {key[0]}/{key[1]} sum to "
                f"{occupied} and {capacity}",
            )
        out[key] = figs
    missing = sorted(set(slots) - set(out))
    if missing:
        raise fail("families", f"no row for the accounts of {'/'.join(missing[0])}")
    return [out[k] for k in sorted(out)]


_family_names = operator.itemgetter("family")
_family_owners = operator.itemgetter("owner")


def _plain_families(rows: list[Any]) -> bool:
    """The common case, every row at once with C-level builtins: exactly the keys, each
    of its type and range. False to take the row-by-row path."""
    if not rows or not plain_rows(rows, _FAMILY_KEYS):
        return not rows
    try:
        names = list(map(_family_names, rows))
        owners = set(map(_family_owners, rows))
        figures = list(itertools.chain.from_iterable(map(_figures, rows)))
    except (KeyError, TypeError):  # a key missing (so another one there), or unhashable
        return False
    return (
        set(map(type, names)) == _STR
        and max(map(len, names)) <= MAX_NAME
        and owners <= OWNERS
        and plain_ints(figures)
    )


def _family(row: Any, i: int) -> dict[str, Any]:
    """One per-family row checked field by field, naming the first fault."""
    where = f"families[{i}]"
    row = as_dict(row, where)
    return {
        "family": str_of(row, "family", where),
        "owner": owner_of(row, where).value,
        **{name: int_of(row, name, where) for name in FIGURE_NAMES},
    }


# Relations of one buffer that hold for a family's sums whenever they hold for each buffer,
# per owner: (smaller, larger, the relation's name in a violation).
_PAIRS = (
    ("tensor_bytes", "reserved_bytes"),
    ("mapped_bytes", "reserved_bytes"),
    ("mapped_bytes", "physical_bytes"),
)
_SUMMED = {
    owner.value: tuple(
        (lo, hi, f"{lo} <= {hi}")
        for lo, hi in (
            *_PAIRS,
            ("occupied_bytes", "mapped_bytes" if owner is Owner.VMM else "tensor_bytes"),
        )
    )
    for owner in Owner
}


def account_may_break(a: dict[str, Any]) -> bool:
    """Whether `check_account` can find a violation in a checked account row (figures
    already >= 0): only then is the AccountRow built to ask it."""
    return a["mapped_pages"] > a["handle_pages"] or a["occupied_slots"] > a["capacity_slots"]


def _violations(
    d: Any, accounts: list[dict[str, Any]], families: list[dict[str, Any]]
) -> list[dict[str, str]]:
    """The listed violations, checked: each account's (recomputed) must be listed, and a
    family whose sums break a relation must list a violation of it."""
    out = []
    for i, v in enumerate(as_list(d, "violations")):
        where = f"violations[{i}]"
        v = as_dict(v, where)
        out.append(
            {
                "subject": str_of(v, "subject", where, 2 * MAX_NAME + 1),
                "relation": str_of(v, "relation", where),
                "detail": str_of(v, "detail", where, MAX_TEXT),
            }
        )
    listed = Counter((v["subject"], v["relation"], v["detail"]) for v in out)
    for a in accounts:
        if not account_may_break(a):
            continue
        for v in check_account(AccountRow.from_dict(a)):
            key = (v.subject, v.relation, v.detail)
            if listed[key] <= 0:
                raise fail(
                    "violations", f"account {a['key']!r:.60} breaks {v.relation}; not listed"
                )
            listed[key] -= 1
    relations = {v["relation"] for v in out}
    for row in families:
        for lo, hi, relation in _SUMMED[row["owner"]]:
            if row[lo] > row[hi] and relation not in relations:
                raise fail(
                    "violations",
                    f"family {row['family']}/{row['owner']} sums to {lo}={row[lo]} > "
                    f"{hi}={row[hi]}; no violation of {relation} listed",
                )
    return out


def buffer_map(head: Head) -> Snapshot:
    """The whole Snapshot of a loaded file: its buffer rows parsed and checked, rollups and
    violations recomputed from them and held against the first line. Refused("buffers",
    detail) when the rows fail or disagree."""
    try:
        rows = as_list(_json(head.rows), "buffers")
        s = head.summary
        snap = Snapshot.build(
            epoch=s["epoch"],
            taken_at=s["taken_at"],
            labels=s["labels"],
            accounts=[AccountRow.from_dict(a) for a in s["accounts"]],
            buffers=[buffer_row(b, i) for i, b in enumerate(rows)],
            tp=head.tp,
        ).with_reconciliation(s["reconciliation"])
        _agrees(summary_of(snap), s)
    except Refused as e:
        if e.reason == "buffers":
            raise
        raise Refused("buffers", f"{e.reason}: {e.detail}") from None
    return snap


def _agrees(rows: dict[str, Any], head: dict[str, Any]) -> None:
    """The summary rebuilt from the buffer rows against the first line's."""
    by_key = {(r["family"], r["owner"]): r for r in head["families"]}
    for r in rows["families"]:
        h = by_key.pop((r["family"], r["owner"]), None)
        where = f"families {r['family']}/{r['owner']}"
        if h is None:
            raise fail(where, "in the buffer rows, not in the first line")
        for name in FIGURE_NAMES:
            if r[name] != h[name]:
                raise fail(
                    where, f"{name}: the rows sum to {r[name]}, the first line says {h[name]}"
                )
    if by_key:
        fam, own = min(by_key)
        raise fail(f"families {fam}/{own}", "in the first line, not in the buffer rows")
    listed = Counter((v["subject"], v["relation"], v["detail"]) for v in head["violations"])
    found = Counter((v["subject"], v["relation"], v["detail"]) for v in rows["violations"])
    extra, missing = found - listed, listed - found
    if extra or missing:
        subject, relation, _ = next(iter(extra or missing))
        where = (
            "found in the buffer rows, not listed in the first line"
            if extra
            else "listed in the first line, not found in the buffer rows"
        )
        raise fail("violations", f"{subject}: {relation} {where}")
