"""accounting.snapfile.head: a file's first line, checked field by field and typed; its buffer
rows, checked when the buffer map is asked for (a failure there is that buffer map's only)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting.figures import Figures
from accounting.rows import AccountRow
from accounting.snapfile.format import Refused
from accounting.snapfile.head import MAX_SKEW_S, buffer_map
from accounting.snapfile.summary import summary_of
from tests.accounting.snapfile.files import copy_of, file_bytes, load_s, refused, rows_refused

_PART = {"account": "accounts", "family": "families"}


@pytest.mark.parametrize(
    "where, key, value, needle",
    [
        ("account", "map_seconds_total", float("inf"), "map_seconds_total"),
        ("account", "unmap_seconds_total", float("nan"), "unmap_seconds_total"),
        ("account", "owner", ["vmm"], "owner"),
        ("account", "mapped_pages", 2**63, "mapped_pages"),
        ("account", "map_bucket_counts", [1, 2], "map_bucket_counts"),
        ("family", "physical_bytes", float("nan"), "physical_bytes"),
        ("family", "mapped_bytes", -1, "mapped_bytes"),
        ("family", "owner", "nobody", "owner"),
        ("family", "family", 7, "family"),
        ("violation", "subject", 7, "subject"),
        ("envelope", "interval", 0, "interval"),
        ("envelope", "interval", float("nan"), "interval"),
        ("envelope", "interval", 1e9, "interval"),
        ("envelope", "sequence", -1, "sequence"),
        ("envelope", "pid", 0, "pid"),
        ("envelope", "source", "other", "file name"),
        ("envelope", "kvledger_publish", 3, "kvledger_publish=3, expected 2"),
        ("snapshot", "labels", {"model_name": 7}, "labels"),
        ("snapshot", "accounts", {}, "accounts: missing column 'key'"),
        ("snapshot", "accounts", [], "accounts: expected an object of columns, got list"),
        ("snapshot", "families", None, "families"),
        ("accounts", "owner", "vmm", "accounts: owner: expected a list, got str"),
        ("families", "mapped_bytes", {}, "families: mapped_bytes: expected a list, got dict"),
        ("snapshot", "violations", "none", "violations"),
        ("snapshot", "epoch", 1.5, "epoch"),
    ],
)
def test_wrong_types_and_out_of_range_figures_in_the_first_line_arerefused(
    published, where, key, value, needle
):
    envelope, rows = copy_of(published)
    snap = envelope["snapshot"]
    snap["violations"].append({"subject": "p/x", "relation": "r", "detail": "d"})
    if where in ("account", "family"):  # one row's value: its place in the field's column
        snap[_PART[where]][key][0] = value
    else:
        target = {
            "accounts": snap["accounts"],  # a whole column
            "families": snap["families"],
            "violation": snap["violations"][-1],
            "envelope": envelope,
            "snapshot": snap,
        }[where]
        target[key] = value
    e = refused(file_bytes(envelope, rows))
    assert e.reason == "schema" and needle in e.detail, e.detail
    if where in ("account", "family"):  # named as a row was
        assert e.detail.startswith(f"{_PART[where]}[0]: "), e.detail


def test_a_heartbeat_in_the_future_isrefused(published):
    envelope, rows, _ = published
    now = envelope["published_at"]
    load_s(file_bytes(envelope, rows), now - MAX_SKEW_S + 0.5)  # within the skew
    e = refused(file_bytes(envelope, rows), now=now - 3600)
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
def test_unparseable_and_deeply_nested_first_lines_arerefused(data, reason):
    assert refused(data).reason == reason


def test_reconciliation_keeps_every_key_a_truth_reader_writes(published):
    """The exporter passes on what accounting.reconcile.result says (basis included), with
    the difference recomputed rather than taken from the file."""
    from accounting.reconcile import result

    envelope, rows = copy_of(published)
    entry = result("nvml", ledger_bytes=100, device_bytes=164, basis="process", detail={"a": 1})
    envelope["snapshot"]["reconciliation"] = [{**entry, "unattributed_bytes": 0}]
    (got,) = load_s(file_bytes(envelope, rows)).summary.reconciliation
    assert got.to_dict() == entry


def test_a_version_1_file_is_refused_by_name(published):
    """A publisher older than the exporter (accounts and families as rows) is told apart
    from a damaged file: the value, the one expected, and what version 1 was."""
    from accounting.snapfile.format import ACCOUNT_FIELDS, FAMILY_FIELDS, rows_of

    envelope, rows = copy_of(published)
    snap = envelope["snapshot"]
    snap["accounts"] = rows_of(snap["accounts"], ACCOUNT_FIELDS)
    snap["families"] = rows_of(snap["families"], FAMILY_FIELDS)
    envelope["kvledger_publish"] = 1
    e = refused(file_bytes(envelope, rows))
    assert e.reason == "schema"
    assert e.detail.startswith("envelope: kvledger_publish=1, expected 2 (version 1: "), e.detail
    envelope["kvledger_publish"] = 2  # rows under the new version: the columns are missing
    assert (
        "accounts: expected an object of columns, got list"
        in refused(file_bytes(envelope, rows)).detail
    )


@pytest.mark.parametrize("part", ["accounts", "families"])
def test_columns_of_different_lengths_or_too_many_rows_are_refused(published, part):
    envelope, rows = copy_of(published)
    columns = envelope["snapshot"][part]
    last = list(columns)[-1]
    columns[last].append(columns[last][0])
    e = refused(file_bytes(envelope, rows))
    assert e.detail.startswith(f"{part}: columns of different lengths: "), e.detail
    envelope, rows = copy_of(published)
    columns = envelope["snapshot"][part]
    for name in columns:
        columns[name] = columns[name][:1] * 100_001
    e = refused(file_bytes(envelope, rows))
    assert e.detail.startswith(f"{part}: 100001 entries, expected at most "), e.detail


def test_an_account_row_with_more_keys_or_whole_seconds_loads_as_its_fields(published):
    envelope, rows = copy_of(published)
    acc = envelope["snapshot"]["accounts"]
    acc["extra"] = ["x"] * len(acc["key"])  # a column no row has: dropped
    acc["map_seconds_total"][0] = 3
    head = load_s(file_bytes(envelope, rows))
    got = head.summary.accounts[0].to_dict()
    assert set(got) == {f.name for f in dataclasses.fields(AccountRow)}
    assert got["map_seconds_total"] == 3.0 and type(got["map_seconds_total"]) is float
    assert buffer_map(head).accounts[0].map_seconds_total == 3.0


_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    where=st.sampled_from(["row", "account", "family", "accounts", "families", "violation"]),
    index=st.integers(0, 1),
    key=st.sampled_from(
        [f.name for f in dataclasses.fields(AccountRow)]
        + ["family", "owner", "name", "pool", "layer", "shape", "dtype", "account", "slot_bytes"]
        + ["tensor_bytes", "reserved_bytes", "physical_bytes", "mapped_bytes", "subject"]
        + ["relation", "detail", "occupied_bytes"]
    ),
    value=_ANY_JSON | st.just(_MISSING := object()),
)
def test_any_value_anywhere_is_served_or_refused_never_an_error(
    published, where, index, key, value
):
    envelope, rows = copy_of(published)
    snap = envelope["snapshot"]
    snap["violations"] = [{"subject": "p/x", "relation": "r", "detail": "d"}] * 2
    if where in _PART:  # one row's value, in its field's column
        columns = snap[_PART[where]]
        if value is _MISSING:
            columns.pop(key, None)
        elif key in columns:
            columns[key][index] = value
        else:
            columns[key] = value
    elif where in ("accounts", "families"):  # a whole column
        if value is _MISSING:
            snap[where].pop(key, None)
        else:
            snap[where][key] = value
    else:
        target = {"row": rows, "violation": snap["violations"]}[where]
        target[index] = dict(target[index])
        if value is _MISSING:
            target[index].pop(key, None)
        else:
            target[index][key] = value
    try:
        head = load_s(file_bytes(envelope, rows))
    except Refused as e:
        assert e.reason == "schema"
        return
    try:
        buffer_map(head)
    except Refused as e:
        assert e.reason == "buffers"


def _with_parts(published, parts, *, violations=()):
    from accounting.gpu_parts import PART_NAMES
    from accounting.reconcile import result

    envelope, rows = copy_of(published)
    full = dict.fromkeys(PART_NAMES, 0)
    full.update(parts)
    entry = result(
        "nvml",
        ledger_bytes=0,
        device_bytes=0,
        basis="process",
        detail={"used_bytes": 1000, "process_used_bytes": 600},
        parts=full,
        uuid="GPU-0",
        gpu="0",
    )
    envelope["snapshot"]["reconciliation"] = [entry]
    envelope["snapshot"]["violations"] += list(violations)
    return file_bytes(envelope, rows)


def test_gpu_parts_that_break_their_relations_unlisted_are_refused(published):
    good = {"weights": 500, "outside_torch": 100, "other_processes": 400}
    (got,) = load_s(_with_parts(published, good)).summary.reconciliation
    assert got.parts["weights"] == 500 and (got.uuid, got.gpu) == ("GPU-0", "0")
    bad = {**good, "weights": 400}  # 100 bytes of the device in no part, no violation listed
    e = refused(_with_parts(published, bad))
    assert e.reason == "schema" and "GPU parts break sum of GPU parts" in e.detail
    listed = [
        {"subject": "truth nvml", "relation": r, "detail": d}
        for r, d in (
            ("sum of GPU parts == NVML device used", "sum=900, device_used=1000"),
            ("process parts + unattributed == NVML process used", "sum=500, process_used=600"),
        )
    ]
    (got,) = load_s(_with_parts(published, bad, violations=listed)).summary.reconciliation
    assert got.parts["weights"] == 400
    e = refused(_with_parts(published, {"vram": 1}))
    assert e.detail.startswith("reconciliation[0].parts: 'vram'")


# -- the buffer rows (buffer_map) ----------------------------------------------------------
def test_the_first_line_gives_what_a_scrape_reads_and_the_rows_round_trip(published):
    envelope, rows, snap = published
    head = load_s(file_bytes(envelope, rows), envelope["published_at"])
    assert head.envelope.source == "s" and head.envelope.interval == 1.0
    assert head.summary == summary_of(snap)
    assert head.rows == json.dumps(rows).encode()  # kept, not parsed
    whole = buffer_map(head)
    assert whole.to_dict() == snap.to_dict()


def test_the_buffer_rows_are_not_parsed_atload_s(published):
    envelope, _ = copy_of(published)
    head = load_s(file_bytes(envelope, b"[" * 200_000 + b"not json"))
    assert head.summary.totals == Figures.of(envelope["snapshot"]["totals"])
    e = rows_refused(file_bytes(envelope, b"[" * 200_000 + b"]" * 200_000))
    assert e.detail.startswith("nesting:")
    assert rows_refused(file_bytes(envelope, b"\xff")).detail.startswith("parse:")


def test_rows_that_disagree_with_the_first_line_fail_the_buffer_map_only(published):
    envelope, rows = copy_of(published)
    for r in rows:
        r["physical_bytes"] = r["mapped_bytes"] = 80 << 30
    head = load_s(file_bytes(envelope, rows))
    assert head.summary.totals == Figures.of(envelope["snapshot"]["totals"])  # what is exported
    e = rows_refused(file_bytes(envelope, rows))
    assert "physical_bytes: the rows sum to" in e.detail
    envelope, rows = copy_of(published)
    envelope["snapshot"]["violations"].append({"subject": "a", "relation": "b", "detail": "c"})
    assert "listed in the first line, not found" in rows_refused(file_bytes(envelope, rows)).detail


@pytest.mark.parametrize(
    "key, value",
    [
        ("physical_bytes", float("nan")),
        ("physical_bytes", -4096),
        ("occupied_slots", "12"),
        ("owner", "nobody"),
        ("owner", ["vmm"]),
        ("shape", [[[1]]]),
        ("layer", True),
    ],
)
def test_bad_buffer_rows_fail_the_buffer_map_naming_the_field(published, key, value):
    envelope, rows = copy_of(published)
    rows[0][key] = value
    e = rows_refused(file_bytes(envelope, rows))
    assert e.detail.startswith("schema: buffers[0]") and key in e.detail


def test_missing_keys_in_the_rows_are_named(published):
    envelope, rows = copy_of(published)
    del rows[1]["account"]
    e = rows_refused(file_bytes(envelope, rows))
    assert "buffers[1]" in e.detail and "'account'" in e.detail
