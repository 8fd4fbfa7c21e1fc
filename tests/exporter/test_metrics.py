from __future__ import annotations

import pytest

from accounting.figures import FIGURES
from exporter import metrics as m


def test_one_gauge_per_figure_generated_from_the_figures_table():
    for f in FIGURES:
        spec = m.METRIC[f"sglang:kv_cache_{f.name}"]
        assert spec.type == "gauge"
        assert spec.labels == ("family", "owner")
        assert spec.figure == f.name
        assert f.meaning in spec.help and f.relation in spec.help


def test_headline_and_service_metrics_are_declared():
    assert m.METRIC[m.HEADLINE].labels == ()
    assert m.METRIC[m.HEADLINE].engine
    for name in ("kvledger_up", "kvledger_snapshot_age_seconds", "kvledger_unattributed_bytes"):
        assert name in m.METRIC
    assert all(s.name.startswith(("sglang:kv_cache_", "kvledger_")) for s in m.METRICS)


def test_sample_names_of_counters_and_histograms():
    assert m.METRIC["kvledger_pages_mapped_total"].family_name == "kvledger_pages_mapped"
    assert m.METRIC["kvledger_map_page_seconds"].sample_names == (
        "kvledger_map_page_seconds_bucket",
    )
    assert "kvledger_up" in m.series_names()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "a.b", "type": "gauge"}, "legacy"),
        ({"name": "x_total", "type": "gauge"}, "_total"),
        ({"name": "x", "type": "counter"}, "_total"),
        ({"name": "x", "type": "summary"}, "type"),
        ({"name": "x", "type": "gauge", "labels": ("bad-label",)}, "label"),
    ],
)
def test_table_refuses_bad_entries(kwargs, match):
    kwargs = {"help": "h", "labels": (), **kwargs}
    with pytest.raises(ValueError, match=match):
        m.MetricSpec(**kwargs)
