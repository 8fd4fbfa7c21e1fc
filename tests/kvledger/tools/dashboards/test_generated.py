"""The committed dashboard and rule files equal the generator's output, and the dashboard keeps
the rules issue 5 sets: variables, descriptions, units, stacking, $__rate_interval."""

from __future__ import annotations

import json
import re

import yaml

from accounting.figures import FIGURES
from exporter import metrics as m
from kvledger.tools.dashboards import files, rules
from kvledger.tools.dashboards.promql import metric_names
from tests.kvledger.tools.dashboards import names

BYTE_FIGURE_METRICS = {m.figure_metric(f.name) for f in FIGURES if f.unit == "bytes"}
SLOT_FIGURE_METRICS = {m.figure_metric(f.name) for f in FIGURES if f.unit == "slots"}
GIB_METRICS = {m.HEADLINE, rules.FLEET_HEADLINE.record}


def _panels() -> list[dict]:
    return [p for p in names.dashboard()["panels"] if p["type"] != "row"]


def test_committed_files_equal_the_generator():
    assert files.stale(names.ROOT) == [], "run: kvledger dashboards --out dashboards"


def test_every_committed_file_comes_from_the_package():
    committed = {str(p.relative_to(names.ROOT)) for p in names.ROOT.rglob("*") if p.is_file()}
    assert committed == set(files.render())


def test_check_reports_a_hand_edit_and_a_missing_file(tmp_path):
    files.write(tmp_path)
    assert files.stale(tmp_path) == []
    target = tmp_path / "prometheus" / "alerts.yml"
    target.write_text(target.read_text().replace("> 0.9", "> 0.5"), encoding="utf-8")
    (tmp_path / "grafana" / "provisioning" / "datasources" / "kvledger.yml").unlink()
    assert files.stale(tmp_path) == [
        "grafana/provisioning/datasources/kvledger.yml",
        "prometheus/alerts.yml",
    ]


def test_readme_lists_every_alert_of_the_rules():
    text = (names.ROOT / "README.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `(\w+)` \| (\w+) \| (\w+) \|", text, re.M)
    assert listed == [(a.name, a.severity, a.for_) for a in rules.ALERTS]
    assert [a for a, _ in names.rule_queries("alerts.yml")] == [a.name for a in rules.ALERTS]


def test_dashboard_is_importable_and_provisionable():
    dash = names.dashboard()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["uid"] == "kvledger-kv-cache" and len(dash["uid"]) <= 40
    assert "id" not in dash  # an id would clash on import into another Grafana
    variables = [v["name"] for v in dash["templating"]["list"]]
    assert variables == ["datasource", "instance", "model_name", "tp_rank", "family"]
    ds = dash["templating"]["list"][0]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]


def test_every_panel_has_a_description_a_unit_and_the_datasource_variable():
    for p in _panels():
        assert len(p["description"]) > 40, p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"


def test_rates_use_rate_interval():
    for title, expr in names.panel_queries():
        for window in re.findall(r"\b(?:rate|irate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", (title, expr)


def _expected_unit(exprs: list[str]) -> str | None:
    used = set().union(*(metric_names(e) for e in exprs))
    text = " ".join(exprs)
    if used & GIB_METRICS:
        return "gbytes"
    if "histogram_quantile" in text and any(n.endswith("_bytes_bucket") for n in used):
        return "bytes"
    if "histogram_quantile" in text and any(n.endswith("_slots_bucket") for n in used):
        return "short"  # slots (tokens, states), like the slot figures
    if "histogram_quantile" in text or any(n.endswith("_seconds_total") for n in used):
        return "s"
    if any(n.endswith(":ratio") for n in used) or " / " in text:
        return "percentunit"
    if used <= SLOT_FIGURE_METRICS:
        return "short"
    if all(n.endswith("_bytes") or n.endswith("_bytes:sum") for n in used):
        return "bytes"
    return None


def test_units_follow_the_metrics():
    checked = 0
    for p in _panels():
        expected = _expected_unit([t["expr"] for t in p["targets"]])
        if expected is None:
            continue
        assert p["fieldConfig"]["defaults"]["unit"] == expected, p["title"]
        checked += 1
    assert checked >= 20
    headline = [p for p in _panels() if m.HEADLINE in p["targets"][0]["expr"]]
    assert headline and all(p["fieldConfig"]["defaults"]["unit"] == "gbytes" for p in headline)


def test_stacking_never_sums_different_figures_or_slot_counts():
    stacked = 0
    for p in _panels():
        custom = p["fieldConfig"]["defaults"].get("custom", {})
        if custom.get("stacking", {}).get("mode", "none") == "none":
            continue
        stacked += 1
        # a series drawn as a line outside the stack (an override) is not summed into it
        apart = [
            o["matcher"]["options"]
            for o in p["fieldConfig"]["overrides"]
            if {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}} in o["properties"]
        ]
        targets = [
            t for t in p["targets"] if not any(re.search(rx, t["legendFormat"]) for rx in apart)
        ]
        assert len(targets) == 1, f"{p['title']}: stacks more than one query"
        used = metric_names(targets[0]["expr"])
        assert len(used) == 1, f"{p['title']}: stacks several metrics {used}"
        assert not used & SLOT_FIGURE_METRICS, f"{p['title']}: stacks slot counts of families"
    assert stacked >= len(BYTE_FIGURE_METRICS)


def test_figures_side_by_side_per_family():
    repeated = [
        p
        for p in _panels()
        if p.get("repeat") == "family" and p["title"] == "$family: figures side by side"
    ]
    assert len(repeated) == 1
    p = repeated[0]
    assert p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "none"
    shown = set().union(*(metric_names(t["expr"]) for t in p["targets"]))
    assert shown == BYTE_FIGURE_METRICS


def test_who_holds_the_kv_cache_row_stacks_the_holders_per_family():
    from accounting.figures import HOLDER_NAMES

    (p,) = [p for p in _panels() if p["title"] == "$family: occupied bytes by holder (stacked)"]
    assert p.get("repeat") == "family"
    assert p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert p["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert "sum by (holder) (sglang:kv_cache_held_bytes" in p["targets"][0]["expr"]
    assert all(h in p["description"] for h in HOLDER_NAMES)
    titles = {q["title"] for q in _panels()}
    assert "Prefix-tree and window evictions per family" in titles
    assert "Unreclaimable share per family (the binding constraint)" in titles


def test_module_check_exits_zero_on_the_committed_files(capsys):
    from kvledger.tools.dashboards.command import main

    assert main(["--check", str(names.ROOT)]) == 0
    assert capsys.readouterr().out == ""


def _targets(config: dict) -> dict[str, list[str]]:
    """job -> its static targets, and those of the file-SD files it reads (from names.PROM)."""
    out: dict[str, list[str]] = {}
    for job in config["scrape_configs"]:
        found = [t for sc in job.get("static_configs", ()) for t in sc["targets"]]
        for fsd in job.get("file_sd_configs", ()):
            for pattern in fsd["files"]:
                for path in sorted(names.PROM.glob(pattern)):
                    found += [t for group in json.loads(path.read_text()) for t in group["targets"]]
        out[job["job_name"]] = found
    return out


def test_no_shipped_target_pages_anyone():
    """The one-node config scrapes this machine only, the file-SD files ship empty, and the
    global config's example federation targets (RFC 2606 `.example` names) sit in a job the
    exporter-down alert does not select: nothing fires for a node the user does not have."""
    down = next(a for a in rules.ALERTS if a.name == "KvLedgerExporterDown")
    job_regex = re.search(r'job=~"([^"]+)"', down.expr)
    assert job_regex, down.expr
    selected = re.compile(job_regex.group(1))
    one_node = _targets(yaml.safe_load((names.PROM / "prometheus.yml").read_text()))
    assert one_node["kvledger-file-sd"] == []
    for job, targets in one_node.items():
        for target in targets:
            assert target.startswith("127.0.0.1:"), (job, target)
    for path in names.PROM.glob("file_sd/*.json"):
        assert json.loads(path.read_text()) == [], path
    fleet = _targets(yaml.safe_load((names.PROM / "prometheus-global.yml").read_text()))
    for job, targets in fleet.items():
        if any(not t.split(":")[0].endswith(".example") for t in targets):
            raise AssertionError(f"{job}: a real-looking example target in {targets}")
        assert not selected.fullmatch(job) or not targets, job
    # and the example is documented
    readme = (names.ROOT / "README.md").read_text()
    assert '"targets": ["gpu-node-1:9400", "gpu-node-2:9400"]' in readme
