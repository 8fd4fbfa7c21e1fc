"""`kvledger bench`: the dispatcher and a tiny run of `bench scrape` (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from kvledger.cli import main


def test_bench_scrape_runs_and_reports_both_measurements(capsys):
    rc = main(
        [
            "bench",
            "scrape",
            "--ranks",
            "2",
            "--scrapes",
            "5",
            "--batch",
            "16",
            "--steps",
            "20",
            "--rounds",
            "2",
            "--publish-interval",
            "0.05",
            "--json",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "scrape: 2 ranks" in out and "overhead" in out
    data = json.loads(out[out.index("{") :])
    assert data["scrape"]["ranks"] == 2
    for key in ("in_process_cached", "in_process_republished", "http_cached", "http_republished"):
        assert data["scrape"][key]["n"] == 5
    assert data["scrape"]["files_parsed_per_republished_scrape"] == 2
    [over] = data["overhead"]
    assert over["batch"] == 16 and over["rounds"] == 2 and over["snapshots_published"] >= 2


def test_missing_benchmark_says_not_available(capsys):
    import importlib.util

    if importlib.util.find_spec("kvledger.bench.tp") is not None:
        pytest.skip("kvledger.bench.tp is present in this build")
    assert main(["bench", "tp"]) == 2
    assert "not available" in capsys.readouterr().err
