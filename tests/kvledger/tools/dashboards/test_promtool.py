"""promtool (Debian's prometheus package) checks the scrape configs and rules and runs the alert
unit tests under dashboards/prometheus/tests/."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.kvledger.tools.dashboards import names

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = pytest.mark.skipif(
    not Path(PROMTOOL).exists(),
    reason="needs promtool (Debian's prometheus; scripts/test installs it)",
)
PROM = names.PROM


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    "config", ["prometheus.yml", "prometheus-global.yml", "prometheus-tls.yml"]
)
def test_check_config(config):
    r = promtool("check", "config", config)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 2 rule files found" in r.stdout


def test_check_config_kubernetes():
    r = promtool("check", "config", "prometheus-kubernetes.yml")
    if r.returncode and "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        pytest.skip("this promtool is built without Kubernetes SD (Debian's package)")
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_rules():
    r = promtool("check", "rules", "recording_rules.yml", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == 2


def test_alert_unit_tests_pass():
    tests = sorted(str(p.relative_to(PROM)) for p in (PROM / "tests").glob("*.yml"))
    assert tests
    r = promtool("test", "rules", *tests)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    text = "\n".join(p.read_text() for p in sorted((PROM / "tests").glob("*.yml")))
    cases = re.findall(r"alertname: (\w+)\n\s+exp_alerts:( \[\])?", text)
    alerts = [a for a, _ in names.rule_queries("alerts.yml")]
    assert alerts
    for alert in alerts:
        quiet = [c for c in cases if c == (alert, " []")]
        firing = [c for c in cases if c == (alert, "")]
        assert quiet and firing, f"{alert}: needs a firing and a quiet promtool case"


def test_the_unit_tests_fail_when_an_alert_breaks(tmp_path):
    """Raise one threshold in a copy: promtool's tests must notice."""
    copy = tmp_path / "prometheus"
    shutil.copytree(PROM, copy)
    alerts = copy / "alerts.yml"
    text = alerts.read_text()
    assert "kvledger_relation_violations > 0" in text
    alerts.write_text(
        text.replace("kvledger_relation_violations > 0", "kvledger_relation_violations > 5")
    )
    r = promtool("test", "rules", "tests/alerts_test.yml", cwd=copy)
    assert r.returncode != 0
    assert "KvLedgerRelationViolation" in r.stdout + r.stderr
