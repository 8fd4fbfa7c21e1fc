"""`kvledger bench scrape --parts scrape`: its percentile and its report (the measurement
itself runs in tests/kvledger/tools/bench/test_command.py)."""

from __future__ import annotations

from typing import Any

from kvledger.tools.bench.scrape_latency import SCRAPE_CASES, percentile, report_scrape


def test_percentile_takes_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0) == 1
    assert percentile(values, 50) == 51  # round(0.5 * 99) = 50 (banker's rounding)
    assert percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0


def _case(p99: float, server: bool) -> dict[str, float]:
    out = {"p50_ms": 1.0, "p99_ms": p99, "max_ms": p99, "n": 5}
    out.update({"cpu_p50_ms": 0.5, "cpu_p99_ms": 0.75, "cpu_max_ms": 1.0})
    if server:
        out["server_cpu_mean_ms"] = 2.0
    return out


def test_report_names_every_case_and_judges_the_republished_gets():
    scrape: dict[str, Any] = {"ranks": 2, "buffers": 334, "series": 350, "exposition_bytes": 60_000}
    for key in SCRAPE_CASES:
        scrape[key] = _case(6.0 if key == "http_republished_gzip" else 4.0, key.startswith("http"))
    lines = report_scrape(scrape)
    assert lines[0] == "scrape: 2 ranks, 334 buffers, 350 series, 60000 bytes per scrape"
    for key in SCRAPE_CASES:
        [line] = [x for x in lines if x.startswith(f"  {key} ")]
        assert ("server cpu mean 2.000 ms" in line) == key.startswith("http")
    assert lines[-3].endswith("(uncompressed): wall met")
    assert lines[-2].endswith("(gzip, as Prometheus asks): wall NOT met")
    assert lines[-1] == "  in-process cpu p99 0.750 ms"
