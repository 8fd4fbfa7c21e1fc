from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from accounting.publisher import Publisher, parse
from exporter.validate import MAX_SKEW_S, Refused, load
from tests.ledgers import small_ledger


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(envelope, buffer rows) of a real published file with every figure non-zero."""
    d = tmp_path_factory.mktemp("snap")
    with small_ledger() as sl:
        sl.allocate(300)
        sl.c4.occupy(9)
        with Publisher(sl.ledger, d, interval=1, source="s") as pub:
            envelope, rows = parse(Path(pub.path).read_bytes())
            sl.free_all()
    return envelope, json.loads(rows)


def _bytes(envelope: dict, rows: list) -> bytes:
    return json.dumps(envelope).encode() + b"\n" + json.dumps(rows).encode()


def _refused(data: bytes, now: float | None = None) -> Refused:
    with pytest.raises(Refused) as e:
        load(data, "s.json", time.time() if now is None else now)
    assert "\n" not in str(e.value)
    return e.value


def test_a_published_file_loads_and_round_trips(published):
    envelope, rows = published
    env, snap = load(_bytes(envelope, rows), "s.json", envelope["published_at"])
    assert env["source"] == "s" and env["interval"] == 1.0
    assert snap.total("occupied_slots") == envelope["snapshot"]["totals"]["occupied_slots"]
    assert snap.to_dict()["families"] == envelope["snapshot"]["families"]


def test_totals_and_violations_are_recomputed_not_trusted(published):
    envelope, rows = published
    forged = json.loads(json.dumps(envelope))
    forged["snapshot"]["totals"]["physical_bytes"] = 80 << 30
    forged["snapshot"]["families"][0]["physical_bytes"] = 80 << 30
    forged["snapshot"]["violations"] = []
    bad_rows = json.loads(json.dumps(rows))
    bad_rows[0]["mapped_bytes"] = bad_rows[0]["physical_bytes"] + bad_rows[0]["page_bytes"]
    _, snap = load(_bytes(forged, bad_rows), "s.json", time.time())
    assert snap.total("physical_bytes") == envelope["snapshot"]["totals"]["physical_bytes"]
    assert any(v.relation == "mapped_bytes <= physical_bytes" for v in snap.violations)


@pytest.mark.parametrize(
    "where, key, value, needle",
    [
        ("row", "physical_bytes", float("nan"), "physical_bytes"),
        ("row", "physical_bytes", -4096, "physical_bytes"),
        ("row", "occupied_slots", "12", "occupied_slots"),
        ("row", "owner", "nobody", "owner"),
        ("row", "shape", [[[1]]], "shape"),
        ("row", "layer", True, "layer"),
        ("account", "map_seconds_total", float("inf"), "map_seconds_total"),
        ("account", "map_bucket_counts", [1, 2], "map_bucket_counts"),
        ("envelope", "interval", 0, "interval"),
        ("envelope", "interval", float("nan"), "interval"),
        ("envelope", "interval", 1e9, "interval"),
        ("envelope", "sequence", -1, "sequence"),
        ("envelope", "pid", 0, "pid"),
        ("envelope", "source", "other", "file name"),
        ("envelope", "kvledger_publish", 2, "kvledger_publish"),
        ("snapshot", "labels", {"model_name": 7}, "labels"),
        ("snapshot", "accounts", {}, "accounts"),
        ("snapshot", "epoch", 1.5, "epoch"),
    ],
)
def test_wrong_types_and_out_of_range_figures_are_refused(published, where, key, value, needle):
    envelope, rows = json.loads(json.dumps(published))
    target = {
        "row": rows[0],
        "account": envelope["snapshot"]["accounts"][0],
        "envelope": envelope,
        "snapshot": envelope["snapshot"],
    }[where]
    target[key] = value
    e = _refused(_bytes(envelope, rows))
    assert e.reason == "schema" and needle in e.detail


def test_missing_keys_are_refused_naming_them(published):
    envelope, rows = json.loads(json.dumps(published))
    del rows[1]["account"]
    e = _refused(_bytes(envelope, rows))
    assert "buffers[1]" in e.detail and "'account'" in e.detail


def test_a_heartbeat_in_the_future_is_refused(published):
    envelope, rows = published
    now = envelope["published_at"]
    load(_bytes(envelope, rows), "s.json", now - MAX_SKEW_S + 0.5)  # within the skew
    e = _refused(_bytes(envelope, rows), now=now - 3600)
    assert "future" in e.detail


@pytest.mark.parametrize(
    "data, reason",
    [
        (b'{"kvledger_publish": 1}', "parse"),
        (b"\xff\xfe\n[]", "parse"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n[]", "nesting"),
        (b"[1]\n[]", "schema"),
    ],
)
def test_unparseable_and_deeply_nested_files_are_refused(data, reason):
    assert _refused(data).reason == reason


def test_reconciliation_keeps_every_key_a_truth_reader_writes(published):
    """The exporter passes on what accounting.reconcile.result says (basis included), with
    the difference recomputed rather than taken from the file."""
    from accounting.reconcile import result

    envelope, rows = published
    entry = result("nvml", ledger_bytes=100, device_bytes=164, basis="process", detail={"a": 1})
    forged = json.loads(json.dumps(envelope))
    forged["snapshot"]["reconciliation"] = [{**entry, "unattributed_bytes": 0}]
    _, snap = load(_bytes(forged, rows), "s.json", time.time())
    (got,) = snap.to_dict()["reconciliation"]
    assert got == entry
