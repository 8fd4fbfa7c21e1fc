from __future__ import annotations

import pytest

from kvledger.tools.dashboards.promql import label_values, metric_names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("kvledger_up", {"kvledger_up"}),
        (
            'sum by (family) (sglang:kv_cache_physical_bytes{family=~"$family"})',
            {"sglang:kv_cache_physical_bytes"},
        ),
        (
            'histogram_quantile(0.99, sum by (le, family) (rate(kvledger_map_page_seconds_bucket{a="b"}[$__rate_interval])))',
            {"kvledger_map_page_seconds_bucket"},
        ),
        ("a / on (x, y) group_left (z) b offset 5m", {"a", "b"}),
        ("abs(x) > 268435456 and y unless bool z", {"x", "y", "z"}),
        ('{__name__="up", job="x"} == 0', set()),
        ("sum without (owner) (rate(m_total[1m] offset 1h)) * 1e6", {"m_total"}),
        ('up{job=~"kvledger.*"} == 0', {"up"}),
    ],
)
def test_metric_names(expr, names):
    assert metric_names(expr) == names


@pytest.mark.parametrize("bad", ["", "  ", None])
def test_metric_names_rejects_empty(bad):
    with pytest.raises(ValueError, match="expr="):
        metric_names(bad)


def test_label_values():
    assert label_values('label_values(kvledger_up{instance=~"$instance"}, model_name)') == (
        'kvledger_up{instance=~"$instance"}',
        "model_name",
    )
    with pytest.raises(ValueError, match="expected label_values"):
        label_values("query_result(up)")
