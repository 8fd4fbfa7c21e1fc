"""`promtool check metrics` (Debian's prometheus package) on kvledger's exposition: every
`kvledger_*` family passes its lint. The `sglang:` names follow SGLang's own metrics (a colon,
`_gb`) and are the documented exception (docs/metrics.md), left out here by name only.

promtool 2.42 reads the text format 0.0.4 only (it would take an OpenMetrics counter's
`# TYPE x counter` / `x_total` pair for two families), so the scrapes ask for text/plain."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from exporter import metrics as m
from exporter.exposition import write_blocks
from tests.kvledger.tools.dashboards.live import KvledgerServe
from tests.servers import wait_until

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus)"
)
EXCEPTION = "sglang:"


def lint(text: str) -> list[str]:
    """promtool's problems, one line each (`NAME reason`); [] when it finds none."""
    r = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert (r.returncode == 0) == (not problems), (r.returncode, problems)
    return problems


def kvledger_problems(text: str) -> list[str]:
    return [p for p in lint(text) if not p.startswith(EXCEPTION)]


def test_every_family_of_the_table_passes():
    """One sample of every metric declared, whatever a live exporter happens to export."""
    blocks = []
    for spec in m.METRICS:
        labels = ",".join(f'{k}="x"' for k in spec.labels)
        if spec.type == "histogram":
            le = ",".join(filter(None, (labels, 'le="+Inf"')))
            lines = [
                f"{spec.name}_bucket{{{le}}} 1\n",
                f"{spec.name}_count{{{labels}}} 1\n",
                f"{spec.name}_sum{{{labels}}} 0.5\n",
            ]
        else:
            lines = [f"{spec.name}{{{labels}}} 1\n"]
        blocks.append((spec.family_name, spec.type, spec.help, lines))
    text = write_blocks(blocks, openmetrics=False).decode()
    problems = lint(text)
    assert kvledger_problems(text) == [], problems
    # promtool does look: the exception's names are flagged, and only they are left out
    assert any(p.startswith(m.HEADLINE) for p in problems), problems


def test_the_lint_can_fail():
    bad = "# HELP kvledger_bad_milliseconds x\n# TYPE kvledger_bad_milliseconds counter\n"
    assert kvledger_problems(bad + "kvledger_bad_milliseconds 1\n")


@pytest.mark.slow
def test_a_live_scrape_passes(tmp_path):
    with KvledgerServe(tmp_path / "snapshots") as serve:

        def scrape() -> str | None:
            """The text exposition once the demo's workload mapped pages (observations)."""
            r = httpx.get(f"{serve.base}/metrics", headers={"Accept": "text/plain"}, timeout=5)
            r.raise_for_status()
            return r.text if "kvledger_map_page_seconds_count{" in r.text else None

        text = wait_until(scrape, 20, "map operations in /metrics")
    assert kvledger_problems(text) == []
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert {
        "kvledger_map_page_seconds_bucket",
        "kvledger_map_page_seconds_count",
        "kvledger_map_page_seconds_sum",
        "kvledger_build_info",
    } <= names
    from kvledger import __version__

    assert 'kvledger_build_info{python_version="' in text
    assert f'version="{__version__}"}} 1\n' in text
