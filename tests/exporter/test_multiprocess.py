"""Two engine processes publishing, one exporter process (`kvledger serve --no-demo`) serving both."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import ServeProcess, repo_env, stop, wait_until

pytestmark = pytest.mark.slow
INTERVAL = 1.0


def _start_publisher(directory, rank: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.exporter.publisher_proc",
            str(directory),
            str(rank),
            str(INTERVAL),
        ],
        stdout=subprocess.PIPE,
        env=repo_env(),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("published "), line
    return proc, line.split()[1]


def _metrics(url: str) -> dict[tuple[str, str], float]:
    """(metric, source-or-tp_rank) -> value for the series the test follows."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=2).text):
        for s in fam.samples:
            if s.name in (
                "kvledger_up",
                "kvledger_snapshot_epoch",
                "kvledger_snapshot_age_seconds",
            ):
                out[(s.name, s.labels["source"])] = s.value
            elif s.name == "sglang:kv_cache_memory_usage_gb":
                out[(s.name, s.labels["tp_rank"])] = s.value
    return out


def test_two_ranks_one_exporter_and_a_killed_rank_goes_stale(tmp_path):
    p0, s0 = _start_publisher(tmp_path, 0)
    p1, s1 = _start_publisher(tmp_path, 1)
    exporter = ServeProcess(
        ["--no-demo", "--port", "0", "--snapshot-dir", str(tmp_path), "--log-interval", "60"],
        stderr=subprocess.PIPE,
    )
    try:
        url = exporter.url + "/metrics"
        assert url.startswith("http://127.0.0.1:"), url
        m = wait_until(
            lambda: (
                lambda d: (
                    d
                    if d.get(("kvledger_up", s0)) == 1 and d.get(("kvledger_up", s1)) == 1
                    else None
                )
            )(_metrics(url)),
            10,
            "both ranks up",
        )
        assert ("sglang:kv_cache_memory_usage_gb", "0") in m
        assert ("sglang:kv_cache_memory_usage_gb", "1") in m

        p0.kill()
        p0.wait()
        killed_at = time.monotonic()
        m = wait_until(
            lambda: (lambda d: d if d.get(("kvledger_up", s0)) == 0 else None)(_metrics(url)),
            INTERVAL,
            "killed rank marked stale within one publish interval",
            interval=0.02,
        )
        assert time.monotonic() - killed_at <= INTERVAL
        assert m[("kvledger_up", s1)] == 1
        assert ("sglang:kv_cache_memory_usage_gb", "0") not in m  # its figures are gone
        epoch1, age0 = m[("kvledger_snapshot_epoch", s1)], m[("kvledger_snapshot_age_seconds", s0)]
        later = wait_until(
            lambda: (lambda d: d if d[("kvledger_snapshot_epoch", s1)] > epoch1 else None)(
                _metrics(url)
            ),
            5 * INTERVAL,
            "the live rank keeps updating",
        )
        assert later[("kvledger_up", s0)] == 0
        assert later[("kvledger_snapshot_age_seconds", s0)] > age0  # the dead one's age grows
        assert later[("kvledger_up", s1)] == 1
    finally:
        for p in (p0, p1):
            stop(p)
        status = exporter.close()
    assert status == 0, exporter.proc.stderr.read() if exporter.proc.stderr else ""
    # p1 closed cleanly on SIGTERM: its file is gone; p0 was killed: its file stays (and is stale)
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"{s0}.json"]
