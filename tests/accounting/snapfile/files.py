"""A real published file for the snapshot-file tests, and ways to change, load and refuse it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from accounting.snapfile.format import Refused, parse
from accounting.snapfile.head import Head, buffer_map, load
from accounting.snapfile.writer import Publisher
from tests.ledgers import small_ledger


def publish_one(directory: Path) -> tuple[dict, list, object]:
    """(envelope, buffer rows, the snapshot published) of a real published file with every
    figure non-zero."""
    with small_ledger() as sl:
        sl.allocate(300)
        sl.c4.occupy(9)
        with Publisher(sl.ledger, directory, interval=1, source="s") as pub:
            envelope, rows = parse(Path(pub.path).read_bytes())
            snap = pub.last_snapshot
            sl.free_all()
    return envelope, json.loads(rows), snap


def file_bytes(envelope: dict, rows: list | bytes) -> bytes:
    raw = rows if isinstance(rows, bytes) else json.dumps(rows).encode()
    return json.dumps(envelope).encode() + b"\n" + raw


def copy_of(published) -> tuple[dict, list]:
    envelope, rows, _ = published
    return json.loads(json.dumps(envelope)), json.loads(json.dumps(rows))


def load_s(data: bytes, now: float | None = None) -> Head:
    return load(data, "s.json", time.time() if now is None else now)


def refused(data: bytes, now: float | None = None) -> Refused:
    with pytest.raises(Refused) as e:
        load_s(data, now)
    assert "\n" not in str(e.value)
    return e.value


def rows_refused(data: bytes) -> Refused:
    head = load_s(data)  # the first line is good: the file is served
    with pytest.raises(Refused) as e:
        buffer_map(head)
    assert e.value.reason == "buffers" and "\n" not in str(e.value)
    return e.value


def with_snapshot(published, *, violations=(), **snapshot) -> bytes:
    """The published file with the snapshot's keys `snapshot` set (an engine state, a
    reconciliation) and `violations` listed besides its own."""
    envelope, rows = copy_of(published)
    envelope["snapshot"].update(snapshot)
    envelope["snapshot"]["violations"] += [
        v if isinstance(v, dict) else v.to_dict() for v in violations
    ]
    return file_bytes(envelope, rows)
