"""The generated prometheus.yml's `sglang` job, run by a real Prometheus (Debian's) against a
stand-in serving `/metrics` exactly as SGLang 0.5.23 does (tests/kvledger/tools/dashboards/sglang_standin.py)
next to `kvledger serve`: SGLang's own KV figure ends up as `..._upstream` in whichever form it
arrives, and kvledger's `sglang:kv_cache_memory_usage_gb` is untouched."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.kvledger.tools.dashboards import names
from tests.kvledger.tools.dashboards.live import KvledgerServe
from tests.servers import PROMETHEUS, Prometheus, repo_env, stop, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="needs Debian's prometheus"),
]
HEADLINE = "sglang:kv_cache_memory_usage_gb"
UPSTREAM = "sglang:kv_cache_memory_usage_gb_upstream"
OPENMETRICS_FORM = "sglang_kv_cache_memory_usage_gb"
SGLANG_VALUE = 1.25


def shipped_config(sglang: str, kvledger: str) -> str:
    """dashboards/prometheus/prometheus.yml with its two static jobs pointed at `sglang` and
    `kvledger`, scraping every second; its relabelling as shipped."""
    config = yaml.safe_load((names.PROM / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s"}
    config.pop("rule_files", None)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["sglang"]["static_configs"] = [{"targets": [sglang]}]
    jobs["kvledger"]["static_configs"] = [{"targets": [kvledger]}]
    jobs["kvledger"]["scrape_interval"] = "1s"
    config["scrape_configs"] = [jobs["sglang"], jobs["kvledger"]]
    return yaml.safe_dump(config, sort_keys=False)


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    multiproc = tmp_path_factory.mktemp("prometheus-multiproc")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.kvledger.tools.dashboards.sglang_standin",
            str(multiproc),
            str(SGLANG_VALUE),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=repo_env(),
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        stop(proc)


def test_the_standin_writes_both_forms(standin):
    """What Prometheus will get: OpenMetrics (asked first) has the underscore form."""
    om = httpx.get(
        f"{standin}/metrics",
        headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"},
        timeout=5,
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert f"\n{OPENMETRICS_FORM}{{" in om.text and f"\n{HEADLINE}{{" not in om.text
    text = httpx.get(f"{standin}/metrics", headers={"Accept": "text/plain"}, timeout=5)
    assert f"\n{HEADLINE}{{" in text.text


def test_sglangs_figure_is_kept_apart_from_kvledgers(standin, tmp_path):
    sglang_target = standin.removeprefix("http://")
    with KvledgerServe(tmp_path / "snapshots") as serve:
        prom = Prometheus([])
        (prom.dir / "prometheus.yml").write_text(shipped_config(sglang_target, serve.target))
        with prom:
            wait_until(
                lambda: (
                    prom.query('up{job="sglang"} == 1')
                    and prom.query('count_over_time(up{job="sglang"}[1m]) >= 3')
                    and prom.query(f'{HEADLINE}{{job="kvledger"}}')
                ),
                40,
                "three scrapes of the stand-in and kvledger's headline",
                interval=0.5,
            )
            upstream = prom.query(UPSTREAM)
            assert [(s["metric"]["job"], float(s["value"][1])) for s in upstream] == [
                ("sglang", SGLANG_VALUE)
            ], upstream
            assert upstream[0]["metric"]["model_name"] == "deepseek-v4-flash"
            # nothing of SGLang's under kvledger's name, in either form
            assert prom.series(f'{HEADLINE}{{job="sglang"}}') == []
            assert prom.series(f'{{__name__="{OPENMETRICS_FORM}"}}') == []
            # kvledger's own headline, untouched: its name, its job, its value
            ours = prom.query(HEADLINE)
            assert {s["metric"]["job"] for s in ours} == {"kvledger"}, ours
            assert all(float(s["value"][1]) > 0 for s in ours), ours
