"""Every metric name `dashboards/` uses, read from the files as committed, with where it is used."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from kvledger.dashboards import files, rules
from kvledger.dashboards.promql import label_values, metric_names

ROOT = files.ROOT
DASHBOARD = ROOT / "grafana" / "dashboards" / "kvledger-kv-cache.json"
PROM = ROOT / "prometheus"
_RULE_LINE = re.compile(r"^\s*(?:- )?(record|expr|alert): (.*)$")
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
            yield var["name"], var["definition"]


def _unquote(text: str) -> str:
    text = text.strip()
    if text.startswith("'") and text.endswith("'"):
        return text[1:-1].replace("''", "'")
    if text.startswith('"'):
        return str(json.loads(text))
    return text


def rule_file(path: Path) -> list[dict[str, str]]:
    """The rules of a file written by kvledger.dashboards.yamlfile: record/alert and expr.

    Reads the committed text (one-line and `|-` block exprs), so a hand edit is seen too."""
    out: list[dict[str, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _RULE_LINE.match(lines[i])
        i += 1
        if not m:
            continue
        key, value = m.group(1), m.group(2)
        if key in ("record", "alert"):
            out.append({key: _unquote(value)})
            continue
        if value.strip() == "|-":
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" " * 10)):
                block.append(lines[i].strip())
                i += 1
            value = " ".join(block)
        out[-1]["expr"] = _unquote(value)
    return out


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
