"""`kvledger bench scrape --parts concurrent`: its report (the measurement itself runs in
tests/kvledger/tools/bench/test_command.py)."""

from __future__ import annotations

from kvledger.tools.bench.scrape_concurrent import report_concurrent


def _st(p50: float, p99: float) -> dict[str, float]:
    return {"n": 5, "min_ms": p50 / 2, "p50_ms": p50, "p99_ms": p99, "max_ms": p99}


def test_report_judges_keep_alive_errors_and_healthz():
    c = {
        "one_client_keep_alive": _st(1.0, 2.0),
        "one_client_fresh_connection": _st(0.5, 1.0),
        "concurrent": [
            {
                "clients": 3,
                "seconds": 1.0,
                "interval": 0.0,
                "requests": 30,
                "errors": {},
                "scrapes_per_second": 30.0,
                "scrape": _st(2.0, 4.0),
                "healthz": _st(1.0, 10.0),
                "healthz_errors": 0,
                "server_cpu_seconds": 0.5,
            },
            {
                "clients": 3,
                "seconds": 1.0,
                "interval": 0.2,
                "requests": 15,
                "errors": {"timeout": 1},
                "scrapes_per_second": 15.0,
                "scrape": _st(2.0, 4.0),
                "healthz": {"n": 0},
                "healthz_errors": 1,
                "server_cpu_seconds": 0.25,
            },
        ],
    }
    lines = report_concurrent(c)
    assert lines[3] == "  keep-alive p50 - fresh p50 = +0.500 ms; target <= +1 ms: met"
    assert lines[4].startswith("3 keep-alive clients, back to back, for 1 s")
    assert lines[7].startswith("  errors 0 ; target 0: met; /healthz p99 target <= 50 ms: met")
    assert lines[8].startswith("3 keep-alive clients, one scrape each per 0.2 s, for 1 s")
    assert lines[10] == "  /healthz (every 20 ms)       (no samples)"
    assert "errors 2 {'timeout': 1}; target 0: NOT met" in lines[11]
    assert lines[11].endswith("/healthz p99 target <= 50 ms: NOT met")
