"""The snapshot file's layout, shared by its writer and its reader.

A file is `<directory>/<source>.json`, two JSON documents, one per line:

    {"kvledger_publish": 2, "source": str, "pid": int, "host": str,
     "process_start": int | null, "interval": float, "published_at": float,
     "sequence": int, "publish_errors": {reason: int}, "last_error": {...} | null,
     "snapshot": Snapshot.to_dict() without "buffers", its "accounts" and
                 "families" written as columns}
    [Snapshot.to_dict()["buffers"]...]

Columns (`accounting.snapfile.columns`): `"accounts": {"key": [...], "family": [...],
...}`, one list per field of an account row (AccountRow's fields, in its order), and
`"families": {"family": [...], "owner": [...], "tensor_bytes": [...], ...}`, one per
field of a family row; every list as long as there are rows. Version 1 wrote both as
lists of row objects; a reader of version 2 refuses it by name (the value and the one
expected), so an old publisher is told apart from a damaged file.

The keys between `kvledger_publish` and `snapshot` are the fields of `Envelope`,
in its order. The first line carries everything a scrape needs (totals,
per-family rollups, accounts, relation violations, reconciliation, TP status)
and parses in O(families + accounts); the buffer rows on the second line are
parsed only when someone asks for the buffer map.

`published_at` is the heartbeat: it advances every interval even when no figure
moved, so a reader tells a dead or hung publisher (heartbeat older than a bound,
or its pid gone) from an idle one. `process_start` (the kernel's start time of
the process, in clock ticks: `accounting.snapfile.process`) tells a reused pid
from the original one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accounting.snapfile.columns import columns_of, rows_of
from accounting.snapfile.publish_errors import Counts, LastError
from accounting.snapfile.summary import ACCOUNT_FIELDS, FAMILY_FIELDS
from accounting.snapshot import Snapshot

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
    # The publisher's failed publishes so far, per reason, and the last one
    # (`accounting.snapfile.publish_errors`); optional in a file.
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
