from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting.buffers import Owner
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.publisher import Publisher, parse
from accounting.relations import check_account
from accounting.snapshot import AccountRow
from exporter.summary import summary_of
from exporter.validate import MAX_SKEW_S, Head, Refused, account_may_break, buffer_map, load
from tests.ledgers import small_ledger


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(envelope, buffer rows, the snapshot published) of a real published file with every
    figure non-zero."""
    d = tmp_path_factory.mktemp("snap")
    with small_ledger() as sl:
        sl.allocate(300)
        sl.c4.occupy(9)
        with Publisher(sl.ledger, d, interval=1, source="s") as pub:
            envelope, rows = parse(Path(pub.path).read_bytes())
            snap = pub.last_snapshot
            sl.free_all()
    return envelope, json.loads(rows), snap


def _bytes(envelope: dict, rows: list | bytes) -> bytes:
    raw = rows if isinstance(rows, bytes) else json.dumps(rows).encode()
    return json.dumps(envelope).encode() + b"\n" + raw


def _copy(published) -> tuple[dict, list]:
    envelope, rows, _ = published
    return json.loads(json.dumps(envelope)), json.loads(json.dumps(rows))


def _load(data: bytes, now: float | None = None) -> Head:
    return load(data, "s.json", time.time() if now is None else now)


def _refused(data: bytes, now: float | None = None) -> Refused:
    with pytest.raises(Refused) as e:
        _load(data, now)
    assert "\n" not in str(e.value)
    return e.value


def _rows_refused(data: bytes) -> Refused:
    head = _load(data)  # the first line is good: the file is served
    with pytest.raises(Refused) as e:
        buffer_map(head)
    assert e.value.reason == "buffers" and "\n" not in str(e.value)
    return e.value


def test_the_first_line_gives_what_a_scrape_reads_and_the_rows_round_trip(published):
    envelope, rows, snap = published
    head = _load(_bytes(envelope, rows), envelope["published_at"])
    assert head.envelope["source"] == "s" and head.envelope["interval"] == 1.0
    assert head.summary == summary_of(snap)
    assert head.rows == json.dumps(rows).encode()  # kept, not parsed
    whole = buffer_map(head)
    assert whole.to_dict() == snap.to_dict()


def test_the_buffer_rows_are_not_parsed_at_load(published):
    envelope, _ = _copy(published)
    head = _load(_bytes(envelope, b"[" * 200_000 + b"not json"))
    assert head.summary["totals"] == envelope["snapshot"]["totals"]
    e = _rows_refused(_bytes(envelope, b"[" * 200_000 + b"]" * 200_000))
    assert e.detail.startswith("nesting:")
    assert _rows_refused(_bytes(envelope, b"\xff")).detail.startswith("parse:")


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: s["totals"].update(physical_bytes=80 << 30), "totals: physical_bytes"),
        (lambda s: s["families"][0].update(occupied_slots=10**9), "sum to"),
        (lambda s: s["families"].pop(), "no row for the accounts"),
        (lambda s: s["families"].append(dict(s["families"][0])), "listed twice"),
        (lambda s: s["accounts"].append(dict(s["accounts"][0])), "listed twice"),
        (
            lambda s: s["accounts"][0].update(mapped_pages=s["accounts"][0]["handle_pages"] + 1),
            "breaks mapped_pages <= handle_pages; not listed",
        ),
    ],
)
def test_figures_the_first_line_can_recompute_are_not_trusted(published, change, needle):
    envelope, rows = _copy(published)
    change(envelope["snapshot"])
    e = _refused(_bytes(envelope, rows))
    assert e.reason == "schema" and needle in e.detail, e.detail


def test_a_family_whose_sums_break_a_relation_must_list_a_violation(published):
    envelope, rows = _copy(published)
    snap = envelope["snapshot"]
    fam = next(f for f in snap["families"] if f["owner"] == "vmm")
    grown = fam["mapped_bytes"] + 1 - fam["occupied_bytes"]
    fam["occupied_bytes"] += grown
    snap["totals"]["occupied_bytes"] += grown
    e = _refused(_bytes(envelope, rows))
    assert "no violation of occupied_bytes <= mapped_bytes listed" in e.detail
    snap["violations"].append(
        {"subject": "p/x", "relation": "occupied_bytes <= mapped_bytes", "detail": "d"}
    )
    head = _load(_bytes(envelope, rows))
    assert len(head.summary["violations"]) == 1  # exported as listed
    # ... and the rows, read later, do not bear the first line out: that buffer map only.
    assert "the rows sum to" in _rows_refused(_bytes(envelope, rows)).detail


def test_rows_that_disagree_with_the_first_line_fail_the_buffer_map_only(published):
    envelope, rows = _copy(published)
    for r in rows:
        r["physical_bytes"] = r["mapped_bytes"] = 80 << 30
    head = _load(_bytes(envelope, rows))
    assert head.summary["totals"] == envelope["snapshot"]["totals"]  # what is exported
    e = _rows_refused(_bytes(envelope, rows))
    assert "physical_bytes: the rows sum to" in e.detail
    envelope, rows = _copy(published)
    envelope["snapshot"]["violations"].append({"subject": "a", "relation": "b", "detail": "c"})
    assert "listed in the first line, not found" in _rows_refused(_bytes(envelope, rows)).detail


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
    envelope, rows = _copy(published)
    rows[0][key] = value
    e = _rows_refused(_bytes(envelope, rows))
    assert e.detail.startswith("schema: buffers[0]") and key in e.detail


def test_missing_keys_in_the_rows_are_named(published):
    envelope, rows = _copy(published)
    del rows[1]["account"]
    e = _rows_refused(_bytes(envelope, rows))
    assert "buffers[1]" in e.detail and "'account'" in e.detail


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
        ("envelope", "kvledger_publish", 2, "kvledger_publish"),
        ("snapshot", "labels", {"model_name": 7}, "labels"),
        ("snapshot", "accounts", {}, "accounts"),
        ("snapshot", "families", None, "families"),
        ("snapshot", "violations", "none", "violations"),
        ("snapshot", "epoch", 1.5, "epoch"),
    ],
)
def test_wrong_types_and_out_of_range_figures_in_the_first_line_are_refused(
    published, where, key, value, needle
):
    envelope, rows = _copy(published)
    snap = envelope["snapshot"]
    snap["violations"].append({"subject": "p/x", "relation": "r", "detail": "d"})
    target = {
        "account": snap["accounts"][0],
        "family": snap["families"][0],
        "violation": snap["violations"][-1],
        "envelope": envelope,
        "snapshot": snap,
    }[where]
    target[key] = value
    e = _refused(_bytes(envelope, rows))
    assert e.reason == "schema" and needle in e.detail


def test_a_heartbeat_in_the_future_is_refused(published):
    envelope, rows, _ = published
    now = envelope["published_at"]
    _load(_bytes(envelope, rows), now - MAX_SKEW_S + 0.5)  # within the skew
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
def test_unparseable_and_deeply_nested_first_lines_are_refused(data, reason):
    assert _refused(data).reason == reason


def test_reconciliation_keeps_every_key_a_truth_reader_writes(published):
    """The exporter passes on what accounting.reconcile.result says (basis included), with
    the difference recomputed rather than taken from the file."""
    from accounting.reconcile import result

    envelope, rows = _copy(published)
    entry = result("nvml", ledger_bytes=100, device_bytes=164, basis="process", detail={"a": 1})
    envelope["snapshot"]["reconciliation"] = [{**entry, "unattributed_bytes": 0}]
    (got,) = _load(_bytes(envelope, rows)).summary["reconciliation"]
    assert got == entry


@given(
    st.fixed_dictionaries(
        {
            k: st.integers(0, 20)
            for k in ("handle_pages", "mapped_pages", "occupied_slots", "capacity_slots")
        }
    )
)
def test_account_may_break_knows_every_relation_check_account_checks(figs):
    """load asks check_account only when account_may_break says it could find something."""
    row = AccountRow(
        key="p/f",
        family="f",
        pool="p",
        owner=Owner.VMM,
        page_bytes=4096,
        peak_occupied_slots=0,
        peak_handle_pages=0,
        pages_mapped_total=0,
        pages_unmapped_total=0,
        map_seconds_total=0.0,
        unmap_seconds_total=0.0,
        map_calls=0,
        map_bucket_counts=(0,) * (len(MAP_SECONDS_BUCKETS) + 1),
        **figs,
    )
    assert bool(check_account(row)) == account_may_break(row.to_dict())


def test_an_account_row_with_more_keys_or_whole_seconds_loads_as_its_fields(published):
    envelope, rows = _copy(published)
    acc = envelope["snapshot"]["accounts"][0]
    acc["extra"] = "x"
    acc["map_seconds_total"] = 3
    head = _load(_bytes(envelope, rows))
    got = head.summary["accounts"][0]
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
    where=st.sampled_from(["row", "account", "family", "violation"]),
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
    envelope, rows = _copy(published)
    snap = envelope["snapshot"]
    snap["violations"] = [{"subject": "p/x", "relation": "r", "detail": "d"}] * 2
    target = {
        "row": rows,
        "account": snap["accounts"],
        "family": snap["families"],
        "violation": snap["violations"],
    }[where][index]
    target = dict(target)
    {"row": rows, "account": snap["accounts"], "family": snap["families"]}.get(
        where, snap["violations"]
    )[index] = target
    if value is _MISSING:
        target.pop(key, None)
    else:
        target[key] = value
    try:
        head = _load(_bytes(envelope, rows))
    except Refused as e:
        assert e.reason == "schema"
        return
    try:
        buffer_map(head)
    except Refused as e:
        assert e.reason == "buffers"
