"""Every metric name used in dashboards/ (panels, variables, rules, alerts, rule tests) is one the
exporter exports (exporter.metrics.METRICS), one our recording rules record, or Prometheus's own."""

from __future__ import annotations

from exporter import metrics as m
from tests.kvledger.tools.dashboards import names


def test_every_name_used_is_exported_or_recorded():
    assert names.used(), "found no metric name in dashboards/: the readers are broken"
    assert names.unknown(m.series_names()) == {}


def test_recording_rules_read_only_exported_names():
    exported = m.series_names()
    for record, expr in names.rule_queries("recording_rules.yml"):
        for name in names.metric_names(expr):
            assert name in exported or name in names.PROMETHEUS_OWN, (record, name)


def test_the_readers_see_the_whole_dashboard():
    dash = names.dashboard()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(list(names.panel_queries(dash))) >= len(panels)
    assert {n for n, _ in names.variable_queries(dash)} == {
        "instance",
        "model_name",
        "tp_rank",
        "family",
    }
    kinds = {("record" if ":" in n else "alert") for n, _ in names.rule_queries()}
    assert kinds == {"record", "alert"}


def test_a_renamed_metric_is_caught():
    """Take one name out of the exporter's table: the check names it and where it is used."""
    exported = m.series_names() - {"kvledger_snapshot_age_seconds"}
    found = names.unknown(exported)
    assert set(found) == {"kvledger_snapshot_age_seconds"}
    assert any(w.startswith("panel ") for w in found["kvledger_snapshot_age_seconds"])
    assert any(w.startswith("rule ") for w in found["kvledger_snapshot_age_seconds"])


def test_every_figure_has_a_per_family_panel():
    used = names.used()
    for spec in m.METRICS:
        if spec.figure is not None:
            assert spec.name in used, f"{spec.name} ({spec.figure}) is on no panel"
