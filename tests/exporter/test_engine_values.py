"""exporter.engine_values: a republished source's lines from its summary's columns, the same
bytes as the series `_add_engine_series` adds, whatever parts a snapshot carries."""

from __future__ import annotations

import dataclasses

import pytest

from accounting.engine_state import REQUEST_BYTES_BUCKETS, EngineState
from accounting.tp_status import TpStatus
from exporter import collector as c
from exporter import engine_values, series
from exporter.collector import KvLedgerCollector
from exporter.exposition import LabelMemo
from exporter.sources import Published, Scan, Sources
from tests.ledgers import small_ledger

_TP = TpStatus(
    rank=0,
    size=2,
    exchanges_total=7,
    page_ops_total=12,
    divergences_total=1,
    peer_failures_total=0,
    last_error="",
)
_ENGINE = EngineState(
    holders_from="test",
    retracted_requests_total=3,
    running_requests=2,
    request_bytes_sum=5000,
    request_bytes_counts=(1,) + (0,) * (len(REQUEST_BYTES_BUCKETS) - 1) + (1,),
)


@pytest.fixture
def versions():
    """A source's snapshots with every part a summary can carry, each one a step on."""
    with small_ledger() as sl:
        src = Sources()
        src.add_ledger(sl.ledger)
        [view] = src.read().views

        def snap():
            return src.read().views[0].snapshot

        out = [snap()]
        sl.allocate(300)
        out.append(dataclasses.replace(snap(), tp=_TP, engine=_ENGINE))
        sl.allocate(5)
        sl.c4.occupy(3)
        out.append(dataclasses.replace(snap(), tp=_TP, engine=_ENGINE))
        yield view, src, out


def _scan(view, snap, sequence):
    published = Published.from_snapshot(snap, source="s", pid=1, host="h", sequence=sequence)
    return Scan((dataclasses.replace(view, published=published),))


def test_the_columns_give_the_values_add_engine_series_adds(versions):
    view, _, snaps = versions
    for i, snap in enumerate(snaps):
        v = _scan(view, snap, i).views[0]
        part = series.LayoutLines(LabelMemo(), None)
        c._add_engine_series(part, v)
        assert snap.reconciliation, "a truth result, so its series are compared too"
        assert engine_values.same(engine_values.values(v.summary), part._values), i


def test_a_republished_source_is_written_from_its_columns_as_a_fresh_render_writes(versions):
    view, src, snaps = versions
    used = []
    real = series.LayoutLines.from_columns

    def spy(self, v, eng):
        used.append(real(self, v, eng))
        return used[-1]

    collector = KvLedgerCollector(src)
    steps = [snaps[i] for i in (0, 1, 2, 1, 2, 0, 2)]
    series.LayoutLines.from_columns = spy  # type: ignore[method-assign]
    try:
        for i, snap in enumerate(steps):
            scan = _scan(view, snap, i + 1)
            for accept in ("text/plain", "application/openmetrics-text; version=1.0.0"):
                body, _ = collector.render(accept, scan)
                fresh, _ = KvLedgerCollector(src).render(accept, scan)
                assert body == fresh, (i, accept)
    finally:
        series.LayoutLines.from_columns = real  # type: ignore[method-assign]
    # 0 -> 1 adds the TP and engine series (a new shape), 1 -> 2, 2 -> 1 and 1 -> 2 are values
    # only (from the columns), 2 -> 0 and 0 -> 2 new shapes again (a fresh collector's first
    # render of a source is never from columns; the second format is a cache hit).
    assert used.count(True) == 3, used


def test_a_layout_whose_column_values_differ_is_never_written_from_columns(versions, monkeypatch):
    """The key is kept only when the columns' values are those `_add_engine_series` added:
    a wrong value there means every later version goes through `_add_engine_series`."""
    view, src, snaps = versions
    real = engine_values.values
    monkeypatch.setattr(engine_values, "values", lambda s: [*real(s)[:-1], -1])
    collector = KvLedgerCollector(src)
    for i, snap in enumerate([snaps[1], snaps[2], snaps[1]]):
        scan = _scan(view, snap, i + 1)
        body, _ = collector.render("text/plain", scan)
        fresh, _ = KvLedgerCollector(src).render("text/plain", scan)
        assert body == fresh and b" -1\n" not in body, i
        assert collector._lines["s"][1].key is None  # type: ignore[attr-defined]


def test_the_shape_key_changes_with_every_part_that_names_a_series(versions):
    view, _, snaps = versions
    s = _scan(view, snaps[2], 1).views[0].summary
    eng = {"model_name": "m"}
    key = engine_values.shape_key(s, eng)
    r = s.reconciliation[0]
    changed = [
        dataclasses.replace(s, tp=None),
        dataclasses.replace(s, engine=None),
        dataclasses.replace(s, reconciliation=()),
        dataclasses.replace(s, reconciliation=(dataclasses.replace(r, source="other"),)),
        dataclasses.replace(
            s,
            reconciliation=(
                dataclasses.replace(r, total_bytes=None if r.total_bytes is not None else 1),
            ),
        ),
        dataclasses.replace(s, reconciliation=(dataclasses.replace(r, available=not r.available),)),
        dataclasses.replace(
            s, account_columns={**s.account_columns, "pool": ["x"] * len(s.accounts)}
        ),
        dataclasses.replace(
            s,
            family_columns={**s.family_columns, "family": ["x"] * len(s.families)},
        ),
    ]
    for i, other in enumerate(changed):
        assert engine_values.shape_key(other, eng) != key, i
    assert engine_values.shape_key(s, {"model_name": "n"}) != key
    assert engine_values.shape_key(dataclasses.replace(s), eng) == key


def test_a_metric_whose_values_did_not_change_keeps_its_lines(versions):
    """Between two snapshots of one shape, a metric with the same values keeps the lines
    written for the previous one (the same list), a metric with others is written again."""
    view, src, snaps = versions
    collector = KvLedgerCollector(src)
    collector.render("text/plain", _scan(view, snaps[1], 1))
    before = collector._lines["s"][1].by_name
    collector.render("text/plain", _scan(view, snaps[2], 2))
    after = collector._lines["s"][1].by_name
    assert after.keys() == before.keys()
    kept = {name for name in after if after[name] is before[name]}
    changed = {name for name in after if after[name] != before[name]}
    assert {"sglang:kv_cache_tensor_bytes", "sglang:kv_cache_capacity_slots"} <= kept, kept
    assert "sglang:kv_cache_occupied_slots" in changed, changed
    assert not kept & changed
