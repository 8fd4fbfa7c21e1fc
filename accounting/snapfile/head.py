"""A file's two lines, read by the exporter: the first checked once per file version, the
buffer rows when someone asks for them.

`load(data, name, now)` runs when a new version of a file is read. It parses and
checks the first line only (O(families + accounts), never O(buffers)) and returns a
`Head`: the `Envelope` and the `Summary` a scrape exports, with the buffer rows kept
as bytes. Checked: the envelope (schema version, `source` equal to the file's name, pid,
host, process start, `interval` within [MIN_INTERVAL_S, MAX_INTERVAL_S], a finite
heartbeat no more than MAX_SKEW_S in the future, a sequence number, the publish errors);
every account, family row, violation and reconciliation entry
(`accounting.snapfile.schema`; the account and family parts are columns); then the
relations between them (`accounting.snapfile.checks`), recomputed: a file whose own
figures disagree is refused (a VMM family's bytes against its accounts' pages, the engine's
requests against the families included), and one that does not list a violation it breaks
(an account's, a family's sums', the GPU parts' and unattributed bytes' against the
device, a request's footprint against the occupied bytes) is refused too. No account,
family or holder record is built here: the `Summary` holds their columns and builds the
records when someone reads them.

JSON nested deeper than the parser allows is refused as "nesting"; anything nested
deeper than the schema is a "schema" refusal.

`buffer_map(head)`, run when someone asks for the buffer map (`/debug/kv`), parses and
checks the second line (`schema.buffer_row`), rebuilds the whole Snapshot from it
(rollups and violations recomputed from the rows) and requires it to agree with the
first line (`checks.rows_agree`). A failure is `Refused("buffers", ...)`: that source's
buffer map is not shown, its metrics (from the first line) are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from accounting.snapfile import checks, schema
from accounting.snapfile.format import (
    ENVELOPE_SCHEMA,
    SUFFIX,
    Envelope,
    Refused,
    check_interval,
    fail,
    publish_errors_of,
)
from accounting.snapfile.request_slots import request_slots_known, request_slots_of
from accounting.snapfile.schema import (
    MAX_NAME,
    as_dict,
    as_list,
    get_field,
    int_of,
    labels_of,
    num_of,
    opt_int_of,
    parse_json,
    str_of,
)
from accounting.snapfile.summary import Summary, summary_of
from accounting.snapshot import SCHEMA_VERSION, Snapshot

MAX_SKEW_S = 5.0  # how far in the future a heartbeat or snapshot time may be (clock skew)


@dataclass(frozen=True)
class Head:
    """A file's first line, checked: all a scrape reads, and what the buffer rows are
    held against when someone asks for them (`buffer_map`)."""

    envelope: Envelope
    summary: Summary
    data: bytes = field(repr=False)  # the whole file
    end: int = 0  # where the first line ends (its newline) in `data`

    @property
    def rows(self) -> bytes:
        """The second line, unparsed (cut from the file's bytes when asked: a scrape never
        asks, so a new version of a file costs no copy of its buffer rows)."""
        return self.data[self.end + 1 :]


def load(data: bytes, name: str, now: float) -> Head:
    """The checked first line of file `name`'s bytes; the buffer rows are kept unparsed."""
    end = data.find(b"\n")
    if end < 0:
        raise Refused("parse", "one line; expected the envelope, a newline, the buffer rows")
    env = as_dict(parse_json(data[:end]), "envelope")
    envelope = _envelope(env, name, now)
    snap = as_dict(get_field(env, "snapshot", "envelope"), "snapshot")
    return Head(envelope, _summary(snap, now), data, end)


def _envelope(env: dict[str, Any], name: str, now: float) -> Envelope:
    version = env.get("kvledger_publish")
    if version != ENVELOPE_SCHEMA:
        older = " (version 1: accounts and families as rows; a publisher older than this exporter)"
        raise fail(
            "envelope",
            f"kvledger_publish={version!r:.60}, expected {ENVELOPE_SCHEMA}"
            + (older if version == 1 and type(version) is int else ""),
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
    errors, last_error = publish_errors_of(env, "envelope")
    return Envelope(
        source=source,
        pid=opt_int_of(env, "pid", "envelope", lo=1),
        host=host,
        process_start=opt_int_of(env, "process_start", "envelope"),
        interval=interval,
        published_at=published_at,
        sequence=int_of(env, "sequence", "envelope"),
        publish_errors=errors,
        last_error=last_error,
    )


def _summary(snap: dict[str, Any], now: float) -> Summary:
    if snap.get("schema") != SCHEMA_VERSION:
        raise fail("snapshot", f"schema={snap.get('schema')!r:.60}, expected {SCHEMA_VERSION}")
    taken_at = num_of(snap, "taken_at", "snapshot")
    if taken_at > now + MAX_SKEW_S:
        raise fail("snapshot", f"taken_at is {taken_at - now:.0f} s in the future")
    accounts = schema.account_table(get_field(snap, "accounts", "snapshot"))
    checks.keys_unique(accounts)
    families = checks.families_match_accounts(
        schema.family_table(get_field(snap, "families", "snapshot")), accounts
    )
    totals = checks.totals(families)
    checks.totals_match(as_dict(get_field(snap, "totals", "snapshot"), "totals"), totals)
    checks.within_bounds(totals)
    checks.whole_pages(families, accounts)
    tp = schema.tp_status(snap.get("tp"))
    epoch = int_of(snap, "epoch", "snapshot")
    labels = labels_of(get_field(snap, "labels", "snapshot"))
    violations = schema.violations_of(get_field(snap, "violations", "snapshot"))
    checks.violations_complete(violations, accounts, families)
    checks.handle_pages_match(families, accounts)
    reconciliation = schema.reconciliation_of(snap.get("reconciliation"))
    checks.parts_violations_listed(violations, reconciliation)
    engine = schema.engine_state_of(snap.get("engine"))
    checks.requests_known(engine, families, totals)
    checks.request_violations_listed(violations, engine, families)
    slots = request_slots_of(snap.get("request_slots"))
    request_slots_known(slots, accounts)
    return Summary(
        epoch=epoch,
        taken_at=taken_at,
        labels=labels,
        totals=totals,
        family_columns=families,
        account_columns=accounts,
        violations=tuple(violations),
        reconciliation=reconciliation,
        tp=tp,
        engine=engine,
        request_slots=slots,
    )


def buffer_map(head: Head) -> Snapshot:
    """The whole Snapshot of a loaded file: its buffer rows parsed and checked, rollups and
    violations recomputed from them and held against the first line. Refused("buffers",
    detail) when the rows fail or disagree."""
    s = head.summary
    try:
        buffers = as_list(parse_json(head.rows), "buffers")
        snap = Snapshot.build(
            epoch=s.epoch,
            taken_at=s.taken_at,
            labels=dict(s.labels),
            accounts=s.accounts,
            buffers=[schema.buffer_row(b, i) for i, b in enumerate(buffers)],
            tp=s.tp,
            engine=s.engine,
            request_slots=s.request_slots,
        ).with_reconciliation(r.to_dict() for r in s.reconciliation)
        checks.rows_agree(summary_of(snap), s)
    except Refused as e:
        if e.reason == "buffers":
            raise
        raise Refused("buffers", f"{e.reason}: {e.detail}") from None
    return snap
