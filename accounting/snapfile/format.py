"""The snapshot file's format, shared by its writer and its reader.

A file is `<directory>/<source>.json`, two JSON documents, one per line:

    {"kvledger_publish": 2, "source": str, "pid": int, "host": str,
     "process_start": int | null, "interval": float, "published_at": float,
     "sequence": int, "publish_errors": {reason: int}, "last_error": {...} | null,
     "snapshot": Snapshot.to_dict() without "buffers", its "accounts" and
                 "families" written as columns}
    [Snapshot.to_dict()["buffers"]...]

The keys between `kvledger_publish` and `snapshot` are the fields of `Envelope`, in its
order. The first line carries everything a scrape needs (totals, per-family rollups,
accounts, relation violations, reconciliation, TP status) and parses in O(families +
accounts); the buffer rows on the second line are parsed only when someone asks for the
buffer map.

Columns: since `kvledger_publish` 2 the first line's account rows and per-family rows are
objects holding one list per field, every list as long as there are rows, the field
names written once (`{"key": [...], "family": [...], ...}`): an account row's fields are
AccountRow's (`ACCOUNT_FIELDS`, in its order), a family row's its name, owner and every
figure (`FAMILY_FIELDS`). The first line of a DeepSeek-V4 rank is then ~2.8 KB instead of
~6.2 KB and parses in about 60 % of the time, and a reader checks a field's values a whole
column at a time. Version 1 wrote both as lists of row objects; a reader of version 2
refuses it by name (the value and the one expected), so an old publisher is told apart
from a damaged file.

`published_at` is the heartbeat: it advances every interval even when no figure moved, so
a reader tells a dead or hung publisher (heartbeat older than a bound, or its pid gone)
from an idle one. `process_start` (the kernel's start time of the process, in clock ticks:
`accounting.snapfile.writer.proc_stat`) tells a reused pid from the original one.
`publish_errors` and `last_error` say why a publisher's publishes failed, if they did: one
reason from a fixed set (`PUBLISH_ERROR_REASONS`), counted in every file, and the last one
(`LastError`) in the file that ends a run of failures only (the first publish that works
again), so a source that goes stale can say why, and an earlier episode's cause is not
carried on as the current one. While a publisher cannot write at all (a full disk, no
inode left, a read-only remount, a directory it may not write), the exporter sees only a
silent source: it then looks at the directory itself (`exporter.sources`,
`accounting.snapfile.reader`) and gives the stale source a last error of its own
(`DIRECTORY_REASONS`) while the cause holds.

A file, or its buffer map, that is not served is `Refused` for one reason from a fixed
set (`REASONS`): a metric is labelled by the reason (`kvledger_snapshot_file_errors_total`),
so the set stays small whatever a directory holds; the detail is one line naming the
field, the value (cut to 60 characters) and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accounting.figures import FIGURE_NAMES
from accounting.rows import AccountRow
from accounting.snapshot import Snapshot

# -- refusals: why a file, or its buffer map, is not served -----------------------------------
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
        if reason not in REASONS:
            raise ValueError(f"Refused: reason={reason!r}, expected one of {REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


# What one source (one rank's ledger) can hold, believed at most: 1 PiB of any byte figure
# is more than any host or GPU node has (a 25,769,803,776 GiB headline is a lie), and
# 2^48 slots more than any pool indexes. Byte figures past it are refused wherever a file
# carries them (totals, GPU parts, truth figures, request footprints).
MAX_SOURCE_BYTES = 1 << 50
MAX_SOURCE_SLOTS = 1 << 48


def fail(where: str, what: str) -> Refused:
    """A "schema" refusal: `where` (e.g. `accounts[3]`) and what is wrong there."""
    return Refused("schema", f"{where}: {what}")


# -- rows written as columns -------------------------------------------------------------------
Columns = dict[str, list[Any]]

# The columns of the first line's parts: an account's fields as AccountRow declares them, a
# family row's as the first line writes it. Owners are held as their values ("vmm"), an
# account's bucket counts as lists.
ACCOUNT_FIELDS = tuple(f.name for f in dataclasses.fields(AccountRow))
FAMILY_FIELDS = ("family", "owner", *FIGURE_NAMES)


def columns_of(rows: Iterable[Mapping[str, Any]], names: Sequence[str]) -> Columns:
    """`rows` (dicts holding every one of `names`) as one list per name (the publisher)."""
    rows = list(rows)
    return {name: [row[name] for row in rows] for name in names}


def rows_of(columns: Mapping[str, Sequence[Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of trusted `columns` (every name present, all of one length): a process
    reading its own files."""
    return [
        dict(zip(names, values, strict=True))
        for values in zip(*(columns[n] for n in names), strict=True)
    ]


def table_of(d: Any, where: str, names: Sequence[str], limit: int) -> Columns:
    """`d` checked as columns, the exporter's first check of such an object: an object with
    a list for each of `names`, all of one length, at most `limit`; "schema" refusals naming
    `where` and the column. Keys it does not name are dropped, as a row's extra keys were."""
    if not isinstance(d, dict):
        raise fail(where, f"expected an object of columns, got {type(d).__name__}")
    try:
        table = {name: d[name] for name in names}
    except KeyError:
        missing = next(n for n in names if n not in d)
        raise fail(where, f"missing column {missing!r}") from None
    columns = table.values()
    if set(map(type, columns)) != {list}:
        name = next(n for n, c in table.items() if type(c) is not list)
        raise fail(where, f"{name}: expected a list, got {type(table[name]).__name__}")
    lengths = set(map(len, columns))
    if len(lengths) > 1:
        first = len(table[names[0]])
        name = next(n for n, c in table.items() if len(c) != first)
        raise fail(
            where,
            f"columns of different lengths: {names[0]} has {first}, {name} {len(table[name])}",
        )
    n = lengths.pop() if lengths else 0
    if n > limit:
        raise fail(where, f"{n} entries, expected at most {limit}")
    return table


# -- why a publish failed, as the envelope carries it -------------------------------------------
PUBLISH_ERROR_REASONS = (
    "no_space",  # ENOSPC or EDQUOT: the filesystem or the quota is full
    "no_inodes",  # ENOSPC with blocks free but no inode left (statvfs f_favail 0): no file
    # can be created, however much room there is
    "read_only",  # EROFS: the filesystem is mounted read-only
    "permission",  # EACCES, EPERM: the directory does not let this user create files
    "directory",  # the directory was replaced by one the rules refuse, or removed
    "other",  # anything else (the log has the traceback)
)
# The reasons the exporter can see for itself on the directory's filesystem (statvfs and an
# access check), for a publisher that cannot write cannot say so: `exporter.sources` shows
# them while they hold, and no longer once they do not.
DIRECTORY_REASONS = ("read_only", "permission", "no_inodes", "no_space")
MAX_DETAIL = 200


@dataclass(frozen=True)
class LastError:
    reason: str  # one of PUBLISH_ERROR_REASONS
    detail: str  # one line
    at: float  # Unix time

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail, "at": self.at}


Counts = tuple[tuple[str, int], ...]  # (reason, failures so far), in PUBLISH_ERROR_REASONS order


def counts_of(counts: Mapping[str, int]) -> Counts:
    return tuple((r, int(counts.get(r, 0))) for r in PUBLISH_ERROR_REASONS)


def publish_errors_of(env: Mapping[str, Any], where: str) -> tuple[Counts, LastError | None]:
    """(`publish_errors`, `last_error`) of a first line's envelope, checked; both optional
    (files of older publishers have neither). Raises the "schema" Refused."""
    reasons = PUBLISH_ERROR_REASONS
    raw = env.get("publish_errors")
    counts: dict[str, int] = {}
    if raw is not None:
        if not isinstance(raw, dict) or len(raw) > len(reasons):
            raise fail(where, "publish_errors: expected an object of reason -> count")
        for reason, n in raw.items():
            if reason not in reasons:
                raise fail(
                    where, f"publish_errors: reason {reason!r:.60}, expected one of {reasons}"
                )
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**63:
                raise fail(where, f"publish_errors[{reason}]={n!r:.60}, expected an integer >= 0")
            counts[reason] = n
    last = env.get("last_error")
    if last is None:
        return counts_of(counts), None
    if not isinstance(last, dict):
        raise fail(where, "last_error: expected an object or null")
    reason, detail, at = last.get("reason"), last.get("detail"), last.get("at")
    if reason not in reasons:
        raise fail(where, f"last_error.reason={reason!r:.60}, expected one of {reasons}")
    if not isinstance(detail, str) or len(detail) > MAX_DETAIL:
        raise fail(
            where, f"last_error.detail: expected a string of at most {MAX_DETAIL} characters"
        )
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
        raise fail(where, f"last_error.at={at!r:.60}, expected a finite number >= 0")
    return counts_of(counts), LastError(reason, " ".join(detail.split()), float(at))


# -- the envelope and the file's two lines -----------------------------------------------------
# 2: the first line's accounts and families are columns (one list per field) instead of
# lists of rows: the same figures in ~45 % of the bytes, parsed and checked a column at a time.
ENVELOPE_SCHEMA = 2
SUFFIX = ".json"
# Publish intervals a publisher accepts and a reader believes (seconds).
MIN_INTERVAL_S = 0.01
MAX_INTERVAL_S = 3600.0
# Labels that name a source, in this order, when present in the ledger's labels.
SOURCE_LABELS = ("model_name", "engine_type", "dp_rank", "pp_rank", "tp_rank", "moe_ep_rank")
_SHORT = {"tp_rank": "tp", "pp_rank": "pp", "dp_rank": "dp", "moe_ep_rank": "ep"}
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Envelope:
    """Who published a snapshot, and when: the first line's keys beside the snapshot."""

    source: str
    pid: int | None
    host: str | None
    process_start: int | None  # clock ticks since boot; None where unknown
    interval: float  # seconds between publishes; 0 for a ledger read in-process
    published_at: float  # the heartbeat (Unix time)
    sequence: int
    # The publisher's failed publishes so far, per reason, and the last one; optional in a file.
    publish_errors: Counts = ()
    last_error: LastError | None = None


def check_interval(value: object, what: str) -> float:
    """`value` as seconds between publishes: a finite number in [MIN_INTERVAL_S,
    MAX_INTERVAL_S], else ValueError naming `what`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S
    ):
        raise ValueError(
            f"{what}={value!r}, expected a number of seconds in "
            f"[{MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}]"
        )
    return float(value)


def check_source(source: str, what: str) -> str:
    """`source` if it can name a file in the directory, else ValueError naming `what`."""
    if _UNSAFE.search(source) or source.startswith("."):
        raise ValueError(
            f"{what}: source={source!r}, expected letters, digits, '_', '.', '-' and no leading '.'"
        )
    return source


def source_id(labels: Mapping[str, str], pid: int) -> str:
    """A file-name-safe id from the engine labels and the pid, e.g. `dsv4-tp0-pp0-pid4242`."""
    parts = []
    for name in SOURCE_LABELS:
        value = labels.get(name)
        if value is None or value == "":
            continue
        short = _SHORT.get(name)
        parts.append(f"{short}{value}" if short else str(value))
    parts.append(f"pid{pid}")
    return _UNSAFE.sub("_", "-".join(parts)).strip("._-") or f"pid{pid}"


def encode(envelope: Envelope, snap: Snapshot) -> bytes:
    """The file's bytes: the envelope and the snapshot without its buffer rows, a newline,
    the buffer rows."""
    body = snap.to_dict()
    buffers = body.pop("buffers")
    body["accounts"] = columns_of(body["accounts"], ACCOUNT_FIELDS)
    body["families"] = columns_of(body["families"], FAMILY_FIELDS)
    fields = dataclasses.asdict(envelope)
    fields["publish_errors"] = {r: n for r, n in envelope.publish_errors if n}
    head = {"kvledger_publish": ENVELOPE_SCHEMA, **fields, "snapshot": body}
    return (
        json.dumps(head, separators=(",", ":")).encode()
        + b"\n"
        + json.dumps(buffers, separators=(",", ":")).encode()
    )


def parse(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(the first line as JSON, the buffer rows' raw JSON) of a file this process trusts
    (its own, or a test's). What an exporter reads goes through `accounting.snapfile.head`."""
    head, sep, rows = data.partition(b"\n")
    if not sep:
        raise ValueError("published file has one line, expected the envelope then the buffer rows")
    envelope = json.loads(head)
    if not isinstance(envelope, dict) or envelope.get("kvledger_publish") != ENVELOPE_SCHEMA:
        got = envelope.get("kvledger_publish") if isinstance(envelope, dict) else type(envelope)
        raise ValueError(f"kvledger_publish={got!r}, expected {ENVELOPE_SCHEMA}")
    return envelope, rows


def snapshot_of(envelope: dict[str, Any], rows: bytes) -> Snapshot:
    """The whole Snapshot of a file `parse` read (parses the buffer rows)."""
    snap = envelope["snapshot"]
    return Snapshot.from_dict(
        {
            **snap,
            "accounts": rows_of(snap["accounts"], ACCOUNT_FIELDS),
            "families": rows_of(snap["families"], FAMILY_FIELDS),
            "buffers": json.loads(rows),
        }
    )
