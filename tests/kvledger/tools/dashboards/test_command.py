"""`kvledger dashboards --out DIR`: what a pip user gets is accepted by promtool (scrape
configs, rules, the alerts' unit tests) and by Grafana's dashboard schema."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import types
from pathlib import Path

import pytest

from kvledger.cli import main
from kvledger.tools.dashboards import files

# grafana-foundation-sdk (dev extra) needs Python >= 3.11.
grafana_schema: types.ModuleType | None
try:
    grafana_schema = importlib.import_module("tests.kvledger.tools.dashboards.grafana_schema")
except ImportError:  # pragma: no cover - Python 3.10 or no SDK installed
    grafana_schema = None
needs_sdk = pytest.mark.skipif(
    grafana_schema is None,
    reason="needs grafana-foundation-sdk (pip install .[dev], Python >= 3.11)",
)
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="needs promtool (Debian's prometheus; scripts/test installs it)"
)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dashboards") / "kvledger-dashboards"
    assert main(["dashboards", "--out", str(d)]) == 0
    return d


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_writes_every_file_and_check_agrees(out, capsys):
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert written == set(files.render())
    assert {"grafana/provisioning/datasources/kvledger.yml", "prometheus/prometheus.yml"} <= written
    capsys.readouterr()
    assert main(["dashboards", "--check", str(out)]) == 0
    assert capsys.readouterr().out == ""


def test_check_names_a_changed_file(tmp_path, capsys):
    assert main(["dashboards", "--out", str(tmp_path)]) == 0
    (tmp_path / "prometheus" / "prometheus.yml").write_text("scrape_configs: []\n")
    capsys.readouterr()
    assert main(["dashboards", "--check", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path}/prometheus/prometheus.yml differs from the generator: "
        f"run kvledger dashboards --out {tmp_path}"
    ]


def test_out_replaces_a_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    out = tmp_path / "out"
    (out / "prometheus").mkdir(parents=True)
    (out / "prometheus" / "alerts.yml").symlink_to(victim)
    assert main(["dashboards", "--out", str(out)]) == 0
    assert victim.read_text() == "untouched\n"
    assert not (out / "prometheus" / "alerts.yml").is_symlink()
    assert files.stale(out) == []


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-global.yml"])
def test_promtool_check_config(out, config):
    r = promtool("check", "config", config, cwd=out / "prometheus")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 2 rule files found" in r.stdout


@needs_promtool
def test_promtool_check_rules(out):
    r = promtool("check", "rules", "recording_rules.yml", "alerts.yml", cwd=out / "prometheus")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == 2


@needs_promtool
def test_promtool_test_rules(out):
    tests = sorted(
        str(p.relative_to(out / "prometheus")) for p in out.glob("prometheus/tests/*.yml")
    )
    assert "tests/alerts_test.yml" in tests
    r = promtool("test", "rules", *tests, cwd=out / "prometheus")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


@needs_sdk
def test_dashboard_matches_grafanas_schema(out):
    data = json.loads((out / "grafana" / "dashboards" / "kvledger-kv-cache.json").read_text())
    assert grafana_schema is not None
    assert grafana_schema.problems(data) == []


@pytest.mark.parametrize(
    ("path", "bad", "expected"),
    [
        (("graphTooltip",), 9, "/graph_tooltip: 9 is not"),
        (("panels", 2, "fieldConfig", "defaults", "custom", "drawStyle"), "zigzag", "draw_style"),
        (("panels", 2, "gridPos", "w"), "8", "/panels[2]/grid_pos/w: '8'"),
        (("templating", "list", 1, "type"), "nope", "'nope' is not a <enum 'VariableType'>"),
        (("panels", 2, "fieldConfig", "defaults", "unitt"), "bytes", "unitt: not a field"),
    ],
)
@needs_sdk
def test_the_schema_check_sees_a_bad_field(out, path, bad, expected):
    data = json.loads((out / "grafana" / "dashboards" / "kvledger-kv-cache.json").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    assert grafana_schema is not None
    found = grafana_schema.problems(data)
    assert any(expected in p for p in found), found
