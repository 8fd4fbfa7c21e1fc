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


@pytest.mark.parametrize(
    ("name", "labels", "unit_words"),
    [
        (m.HEADLINE, (), ("GiB", "2^30", "physical bytes")),
        ("kvledger_up", ("source",), ("1 while", "0 once")),
        ("kvledger_snapshot_age_seconds", ("source",), ("Seconds",)),
        ("kvledger_snapshot_epoch", ("source",), ("Changes",)),
        ("kvledger_unattributed_bytes", ("truth",), ("minus the ledger's physical bytes",)),
    ],
)
def test_headline_and_service_metrics_are_declared(name, labels, unit_words):
    """Each is a gauge with SGLang's engine labels plus its own, and its help states its unit."""
    spec = m.METRIC[name]
    assert (spec.type, spec.labels, spec.engine, spec.figure) == ("gauge", labels, True, None)
    for word in unit_words:
        assert word in spec.help, (name, word)
    assert all(s.name.startswith(("sglang:kv_cache_", "kvledger_")) for s in m.METRICS)


def test_headline_and_service_metrics_carry_their_values():
    """The values behind those declarations, against numbers known without the exporter: the
    host backend's memfd blocks and the runtime tensors' sizes."""
    from exporter.collector import registry_for
    from exporter.sources import Sources
    from tests.ledgers import small_ledger

    with small_ledger({"model_name": "m", "tp_rank": "0"}, layers=3) as sl:
        sl.allocate(700)
        src = Sources()
        source = src.add_ledger(sl.ledger)
        reg = registry_for(src)
        eng = {
            "model_name": "m",
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        runtime = 3 * 64 * 584 + 32 * 2048 * 4  # the c4_kv tensors and the state tensor
        physical = sl.backend.physical_bytes() + runtime
        assert sl.backend.physical_bytes() > 0
        assert reg.get_sample_value(m.HEADLINE, eng) == physical / 2**30
        assert reg.get_sample_value("kvledger_up", {**eng, "source": source}) == 1
        age = reg.get_sample_value("kvledger_snapshot_age_seconds", {**eng, "source": source})
        assert age is not None and 0 <= age < 60
        truth = {**eng, "truth": "host_memfd"}
        assert reg.get_sample_value("kvledger_unattributed_bytes", truth) == 0


def test_sample_names_of_counters_and_histograms():
    assert m.METRIC["kvledger_pages_mapped_total"].family_name == "kvledger_pages_mapped"
    assert m.METRIC["kvledger_map_page_seconds"].sample_names == (
        "kvledger_map_page_seconds_bucket",
        "kvledger_map_page_seconds_count",
        "kvledger_map_page_seconds_sum",
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


def test_register_refuses_a_name_declared_twice_and_adds_nothing(monkeypatch) -> None:
    monkeypatch.setattr(m, "METRICS", m.METRICS)
    monkeypatch.setattr(m, "METRIC", dict(m.METRIC))
    before = m.METRICS
    spec = m.MetricSpec("kvledger_test_x", "gauge", "h", (), engine=False)
    other = m.MetricSpec("kvledger_test_y", "gauge", "h", (), engine=False)
    with pytest.raises(ValueError, match=r"\['kvledger_test_x'\] are declared already"):
        m.register([other, spec, spec])  # twice in one call
    with pytest.raises(ValueError, match=r"\['kvledger_up'\] are declared already"):
        m.register([other, m.METRIC["kvledger_up"]])
    assert before == m.METRICS and "kvledger_test_y" not in m.METRIC
    m.register([other, spec])
    assert (*before, other, spec) == m.METRICS and m.METRIC["kvledger_test_x"] is spec
    assert m.markdown_table() == m.markdown_table(m.CORE_METRICS)  # the docs table: core only
