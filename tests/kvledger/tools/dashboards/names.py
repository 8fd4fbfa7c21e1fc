"""Every metric name `dashboards/` uses, read from the files as committed, with where it is used."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

from kvledger.tools.dashboards import rules
from kvledger.tools.dashboards.promql import label_values, metric_names

ROOT = Path(__file__).resolve().parents[4] / "dashboards"  # the repository's copy
DASHBOARD = ROOT / "grafana" / "dashboards" / "kvledger-kv-cache.json"
PROM = ROOT / "prometheus"
_SERIES = re.compile(r"""^\s*- series: '([A-Za-z_:][A-Za-z0-9_:]*)[{']""", re.MULTILINE)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panel_queries(dash: dict | None = None) -> Iterator[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    for panel in (dash or dashboard())["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]


def variable_queries(dash: dict | None = None) -> Iterator[tuple[str, str]]:
    for var in (dash or dashboard())["templating"]["list"]:
        if var["type"] == "query":
            yield var["name"], var["query"]


def rule_file(path: Path) -> list[dict[str, str]]:
    """The rules of a rule file (record or alert, and expr), parsed from the committed text."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def rule_queries(*files: str) -> Iterator[tuple[str, str]]:
    """(record or alert name, expr) of the rule files (default: recording rules and alerts)."""
    for name in files or ("recording_rules.yml", "alerts.yml"):
        for rule in rule_file(PROM / name):
            yield rule.get("record") or rule["alert"], rule["expr"]


def recorded_names() -> frozenset[str]:
    return frozenset(r["record"] for r in rule_file(PROM / "recording_rules.yml"))


def test_series_names() -> Iterator[tuple[str, str]]:
    for path in sorted((PROM / "tests").glob("*.yml")):
        for name in _SERIES.findall(path.read_text(encoding="utf-8")):
            yield path.name, name


def used() -> dict[str, set[str]]:
    """metric name -> where it is used."""
    out: dict[str, set[str]] = {}
    for where, expr in (
        *(("panel " + t, e) for t, e in panel_queries()),
        *(("variable " + n, label_values(e)[0]) for n, e in variable_queries()),
        *(("rule " + n, e) for n, e in rule_queries()),
    ):
        for name in metric_names(expr):
            out.setdefault(name, set()).add(where)
    for where, name in test_series_names():
        out.setdefault(name, set()).add(where)
    return out


PROMETHEUS_OWN = rules.PROMETHEUS_SERIES


def unknown(exported: frozenset[str]) -> dict[str, list[str]]:
    """Names used here that are neither in `exported`, recorded by our rules, nor Prometheus's."""
    recorded = recorded_names()
    return {
        name: sorted(where)
        for name, where in used().items()
        if name not in exported and name not in recorded and name not in PROMETHEUS_OWN
    }
