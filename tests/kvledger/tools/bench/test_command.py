"""`kvledger bench`: the dispatcher and a tiny run of `bench scrape` (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from kvledger.cli import main
from kvledger.tools.bench.scrape_latency import SCRAPE_CASES


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
            "--seconds",
            "0.05",
            "--block-ms",
            "1",
            "--publish-interval",
            "0.05",
            "--clients",
            "3",
            "--concurrent-seconds",
            "1",
            "--client-intervals",
            "0,0.2",
            "--json",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "scrape: 2 ranks" in out and "overhead" in out
    assert "3 keep-alive clients, back to back" in out
    assert "3 keep-alive clients, one scrape each per 0.2 s" in out
    data = json.loads(out[out.index("{") :])
    assert data["scrape"]["ranks"] == 2
    for key in SCRAPE_CASES:
        assert data["scrape"][key]["n"] == 5
    assert "http_republished_gzip" in SCRAPE_CASES
    assert "(gzip, as Prometheus asks): wall" in out
    assert data["scrape"]["files_parsed_per_republished_scrape"] == 2
    conc = data["concurrent"]
    assert conc["one_client_keep_alive"]["n"] == conc["one_client_fresh_connection"]["n"] == 5
    assert [c["interval"] for c in conc["concurrent"]] == [0.0, 0.2]
    for c in conc["concurrent"]:
        assert c["errors"] == {} and c["healthz_errors"] == 0
        assert c["requests"] >= 3 and c["healthz"]["n"] >= 1
    [over] = data["overhead"]
    assert over["batch"] == 16 and over["snapshots_published"] >= 1
    assert over["blocks_per_pool"] >= 1 and over["steps_per_block"] >= 1
    for pool in ("bare", "control", "accounted"):
        assert over[f"{pool}_step_us"] > 0


def test_missing_benchmark_says_not_available(capsys, monkeypatch):
    """A benchmark whose module is not in this build is listed, and running it says so."""
    from kvledger.tools import bench

    monkeypatch.setitem(bench.BENCHMARKS, "absent", "a benchmark left out of this build")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "absent" in capsys.readouterr().out
    assert main(["bench", "absent"]) == 2
    assert capsys.readouterr().err == (
        "kvledger bench: 'absent' is not available in this build (kvledger.tools.bench.absent)\n"
    )


def test_overhead_refuses_bad_arguments_naming_them():
    from kvledger.tools.bench.overhead import bench_overhead

    with pytest.raises(ValueError, match="batch=0"):
        bench_overhead(batch=0, seconds=0.01, publish_interval=1.0)
    with pytest.raises(ValueError, match="seconds=0"):
        bench_overhead(batch=1, seconds=0, publish_interval=1.0)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--seconds", "nan"], "--seconds: 'nan'"),
        (["--concurrent-seconds", "inf"], "--concurrent-seconds: 'inf'"),
        (["--ranks", "0"], "--ranks: '0'"),
        (["--publish-interval", "0"], "--publish-interval: '0'"),
        (["--client-intervals", "1,nan"], "--client-intervals"),
        (["--parts", "bogus"], "--parts"),
    ],
)
def test_bench_scrape_refuses_bad_numbers_with_one_line(capsys, args, needle):
    with pytest.raises(SystemExit) as e:
        main(["bench", "scrape", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
