"""Every panel query, variable query, recording rule and alert of dashboards/, evaluated by a real
Prometheus (Debian's package) scraping a running `kvledger serve` with its built-in workload.

Grafana's variables are replaced by concrete values read from Prometheus (this instance, the
demo's model and rank, each family in turn) and then by the "All" regex `.*`.
"""

from __future__ import annotations

import os
import re

import pytest

from exporter import metrics as m
from kvledger.demo.source import DEFAULT_HOST_GRANULARITY
from kvledger.engines.vllm import metrics as vllm_metrics
from kvledger.tools.dashboards import rules
from kvledger.tools.dashboards.promql import label_values, metric_names
from tests.kvledger.tools.dashboards import names
from tests.kvledger.tools.dashboards.live import KvledgerServe, RulesPrometheus
from tests.servers import PROMETHEUS, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="needs Debian's prometheus"),
]
RATE_INTERVAL = "5s"  # Grafana: max(4 x scrape interval, interval + scrape interval) at 1 s scrapes
# Alerts that must stay quiet on the healthy demo (its truth is exact, its sources live).
QUIET = (
    "KvCacheUnattributedBytes",
    "KvLedgerSourceDown",
    "KvLedgerSnapshotStale",
    "KvLedgerExporterDown",
    "KvLedgerRelationViolation",
)


def substitute(expr: str, values: dict[str, str]) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        out = out.replace("${" + name + "}", value).replace("$" + name, value)
    left = re.findall(r"\$\{?\w+", out)
    if left:
        raise AssertionError(f"unreplaced Grafana variables {left} in {out!r}")
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with (
        KvledgerServe(tmp_path_factory.mktemp("snapshots")) as serve,
        RulesPrometheus([serve.target]) as prom,
    ):
        # a few scrapes and rule evaluations, with pages mapped and unmapped in between
        wait_until(
            lambda: (
                prom.query("count_over_time(kvledger_up[1m]) >= 5")
                and prom.query(f"rate(kvledger_pages_mapped_total[{RATE_INTERVAL}]) > 0")
                and prom.query(f"rate(kvledger_pages_unmapped_total[{RATE_INTERVAL}]) > 0")
                and prom.query("model_name_family:kvledger_kv_cache_slot_occupancy:ratio")
            ),
            40,
            "five scrapes, page maps and unmaps, recorded series",
            interval=0.5,
        )
        yield serve, prom


def _concrete(prom: RulesPrometheus, serve: KvledgerServe) -> dict[str, str]:
    up = prom.series("kvledger_up")
    assert len(up) == 1, up
    return {
        "instance": serve.target,
        "model_name": up[0]["model_name"],
        "tp_rank": up[0]["tp_rank"],
    }


def _families(prom: RulesPrometheus) -> list[str]:
    fams = sorted({s["family"] for s in prom.series("sglang:kv_cache_physical_bytes")})
    assert len(fams) == 7, fams  # the demo's DeepSeek-V4-shaped pool: all seven families
    return fams


def _vmm_only(prom: RulesPrometheus, vmm: set[str]) -> set[str]:
    """Metrics the exporter writes only for VMM-owned families (allocator activity)."""
    out = set()
    for name in m.series_names():
        fams = {s.get("family") for s in prom.series(name)}
        if fams and None not in fams and fams <= vmm:
            assert fams == vmm, (name, fams)
            out.add(name)
    return out


def test_every_panel_query_returns_data(stack):
    serve, prom = stack
    concrete = _concrete(prom, serve)
    families = _families(prom)
    vmm = {s["family"] for s in prom.series('sglang:kv_cache_physical_bytes{owner="vmm"}')}
    assert vmm == {"swa_kv"}, vmm  # the demo: SWA on the VMM allocator, the rest runtime-owned
    vmm_only = _vmm_only(prom, vmm)
    assert "kvledger_pages_mapped_total" in vmm_only
    passes = [{**concrete, "family": f} for f in [*families, ".*"]]
    passes.append({"instance": ".*", "model_name": ".*", "tp_rank": ".*", "family": ".*"})
    empty, checked, skipped = [], 0, 0
    for values in passes:
        for title, expr in names.panel_queries():
            if values["family"] not in vmm | {".*"} and metric_names(expr) & vmm_only:
                skipped += 1  # allocator activity of a runtime-owned family: none, correctly
                continue
            if metric_names(expr) & m.GPU_ONLY:
                skipped += 1  # the host backend has no GPU: tests/kvledger/tools/dashboards/test_gpu_row.py
                continue
            if all(n.startswith(vllm_metrics.PREFIX) for n in metric_names(expr)):
                skipped += 1  # the vLLM row: no vLLM engine in the demo (tests/kvledger/vllm)
                continue
            q = substitute(expr, values)
            if not prom.query_at(q):
                empty.append((title, q))
            checked += 1
    assert not empty, f"{len(empty)} of {checked} panel queries returned nothing: {empty[:5]}"
    assert checked >= 9 * 30 and skipped < checked


def test_every_variable_query_lists_values(stack):
    serve, prom = stack
    concrete = _concrete(prom, serve)
    for name, definition in names.variable_queries():
        selector, label = label_values(definition)
        for values in (concrete, dict.fromkeys(concrete, ".*")):
            found = {s.get(label) for s in prom.series(substitute(selector, values))} - {None}
            assert found, (name, selector, values)
            if name in concrete:
                assert concrete[name] in found


def test_every_recording_rule_expr_and_recorded_series_has_data(stack):
    _, prom = stack
    recorded = list(names.rule_queries("recording_rules.yml"))
    assert len(recorded) == len(rules.RECORDED)
    for record, expr in recorded:
        assert prom.query_at(expr), f"recording rule {record}: {expr} returned nothing"
        assert prom.query_at(record), f"{record} has no recorded series"
    loaded = {r["name"]: r for r in prom.rules()}
    for record, _ in recorded:
        assert loaded[record]["health"] == "ok", loaded[record]


def test_alerts_load_and_stay_quiet_on_the_healthy_demo(stack):
    serve, prom = stack
    loaded = {r["name"]: r for r in prom.rules() if r["type"] == "alerting"}
    assert set(loaded) == {a.name for a in rules.ALERTS}
    for alert in rules.ALERTS:
        assert loaded[alert.name]["health"] == "ok", loaded[alert.name]
        result = prom.query_at(alert.expr)
        if alert.name in QUIET:
            assert result == [], f"{alert.name} would fire on the healthy demo: {result}"
    # and the inputs of the quiet ones exist, so "quiet" is not "querying nothing"
    for expr in (
        "kvledger_unattributed_bytes",
        "kvledger_up == 1",
        "kvledger_snapshot_age_seconds",
        'up{job="kvledger"} == 1',
        "kvledger_relation_violations == 0",
    ):
        assert prom.query_at(expr), expr
    assert serve.debug()["sources"][0]["violations"] == []


def test_truth_panel_compares_the_figure_the_truth_is_reconciled_with(stack):
    """Both lines of "Device truth vs ledger ..." are the same quantity on the healthy demo:
    truth minus the ledger line is the exported unattributed bytes, 0 (the demo reads its
    host truth with the page store quiescent: tests/kvledger/demo/test_source_truth.py), never the
    runtime-owned families' bytes. The two lines are compared inside one query, so both are
    the samples of one scrape: two queries, each evaluated at its own "now", could straddle a
    scrape and compare snapshots taken a second apart, a page id or more apart."""
    serve, prom = stack
    [(title, truth_expr), (_, ledger_expr)] = [
        (t, e) for t, e in names.panel_queries() if t.startswith("Device truth vs ledger")
    ]
    values = {**_concrete(prom, serve), "family": ".*"}
    truth_q, ledger_q = substitute(truth_expr, values), substitute(ledger_expr, values)
    on = "on(instance, model_name, tp_rank)"
    unattributed_q = substitute('kvledger_unattributed_bytes{instance="$instance"}', values)
    # one result series per instant: truth, ledger, truth - ledger, the exported gap
    both = prom.query_at(
        f'label_replace({truth_q}, "line", "truth", "", "")'
        f' or label_replace({ledger_q}, "line", "ledger", "", "")'
        f' or label_replace(({truth_q}) - {on} ({ledger_q}), "line", "gap", "", "")'
        f" or label_replace(sum by (instance, model_name, tp_rank) ({unattributed_q}),"
        ' "line", "unattributed", "", "")'
    )
    lines = {s["metric"]["line"]: float(s["value"][1]) for s in both}
    assert len(both) == len(lines) == 4, (title, both)
    assert lines["gap"] == lines["truth"] - lines["ledger"], lines
    assert lines["gap"] == lines["unattributed"] == 0, (
        f"{title}: truth {lines['truth']:.0f} B, ledger {lines['ledger']:.0f} B, "
        f"{lines['gap'] / DEFAULT_HOST_GRANULARITY:+.0f} granules, "
        f"exported unattributed {lines['unattributed']:.0f} B; expected 0"
    )
    # ... while all families' physical bytes are far more than the truth sees
    all_physical = prom.query_at(
        f'sum(sglang:kv_cache_physical_bytes{{instance="{serve.target}"}})'
    )
    assert float(all_physical[0]["value"][1]) > lines["truth"] + 8 * (1 << 20)
