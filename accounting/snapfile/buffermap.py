"""A file's buffer rows, read when someone asks for the buffer map (`/debug/kv`).

`buffer_map(head)` parses and checks the second line (`accounting.snapfile.schema`),
rebuilds the whole Snapshot from it (rollups and violations recomputed from the
rows) and requires it to agree with the first line (`accounting.snapfile.checks`).
A failure is `Refused("buffers", ...)`: that source's buffer map is not shown, its
metrics (from the first line) are.
"""

from __future__ import annotations

from accounting.snapfile import checks, schema
from accounting.snapfile.head import Head
from accounting.snapfile.refusal import Refused
from accounting.snapfile.schema import as_list, parse_json
from accounting.snapfile.summary import summary_of
from accounting.snapshot import Snapshot


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
        ).with_reconciliation(r.to_dict() for r in s.reconciliation)
        checks.rows_agree(summary_of(snap), s)
    except Refused as e:
        if e.reason == "buffers":
            raise
        raise Refused("buffers", f"{e.reason}: {e.detail}") from None
    return snap
