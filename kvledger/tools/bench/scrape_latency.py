"""Part `scrape` of `kvledger bench scrape`: scrape latency over many ranks.

The exposition built in-process (collector + text rendering), and a full `GET /metrics` over
loopback from `kvledger serve --no-demo` in its own process (uvicorn; the exporter as
deployed); once with every file unchanged since the last scrape (cache hits) and once with
every rank republished before each scrape (every file parsed again), and the republished GET
once more asked for the way Prometheus asks (its Accept header and gzip). Wall-clock and CPU:
this process's per scrape, and the exporter process's mean from /proc.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from kvledger.tools.bench.loadgen import ACCEPT as PROMETHEUS_ACCEPT
from kvledger.tools.bench.scrape_ranks import rank_files
from kvledger.tools.bench.serve_child import ServeChild

# What the scrape cases but the gzip one ask for: OpenMetrics, uncompressed.
PLAIN_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
SCRAPE_CASES = (
    "in_process_cached",
    "in_process_republished",
    "http_cached",
    "http_republished",
    "http_republished_gzip",
)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "n": len(ms),
    }


def bench_scrape(ranks: int, budget: int, scrapes: int) -> dict[str, Any]:
    import http.client

    from exporter.collector import KvLedgerCollector
    from exporter.sources import Sources

    with contextlib.ExitStack() as stack:
        directory, buffers, republish = rank_files(stack, ranks, budget)
        republish()
        sources = Sources(directory)
        renderer = KvLedgerCollector(sources)  # what GET /metrics calls
        accept = PLAIN_ACCEPT
        body, _ = renderer.render(accept)
        series = sum(1 for line in body.decode().splitlines() if line and line[0] != "#")

        def timed(
            fn: Callable[[], Any], before: Callable[[], None] | None = None
        ) -> dict[str, float]:
            """Wall-clock and CPU of this process per scrape (for HTTP: the client's)."""
            wall, cpu = [], []
            for _ in range(scrapes):
                if before is not None:
                    before()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            out = _summary(wall)
            out.update({f"cpu_{k}": v for k, v in _summary(cpu).items() if k != "n"})
            return out

        for _ in range(20):  # warm up
            renderer.render(accept)
        results: dict[str, Any] = {
            "ranks": ranks,
            "buffers": buffers,
            "series": series,
            "exposition_bytes": len(body),
        }
        results["in_process_cached"] = timed(lambda: renderer.render(accept))
        parses = sources.read().files.parses  # files unchanged since: this read parses none
        results["in_process_republished"] = timed(lambda: renderer.render(accept), republish)
        parsed = sources.read().files.parses - parses
        results["files_parsed_per_republished_scrape"] = parsed / scrapes

        # No background scanning: every republished file is parsed by the scrape itself (the
        # worst case; the concurrent part runs `serve` as deployed).
        server = stack.enter_context(
            ServeChild(
                [
                    "--no-demo",
                    "--port",
                    "0",
                    "--snapshot-dir",
                    directory,
                    "--log-interval",
                    "3600",
                    "--scan-interval",
                    "0",
                ]
            )
        )
        host, port = server.url.split("//", 1)[1].rsplit(":", 1)
        plain = {"Accept": accept}
        prometheus = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
        for key, before, headers in (
            ("http_cached", None, plain),
            ("http_republished", republish, plain),
            ("http_republished_gzip", republish, prometheus),
        ):
            # One keep-alive connection per case, as a scraper keeps one per target; the
            # standard library's client, whose own cost per request is a fraction of httpx's.
            conn = http.client.HTTPConnection(host, int(port), timeout=10)

            def get(
                conn: http.client.HTTPConnection = conn, headers: dict[str, str] = headers
            ) -> None:
                conn.request("GET", "/metrics", headers=headers)
                r = conn.getresponse()
                r.read()  # as sent: a gzip body is not decompressed (the client's work)
                if r.status != 200:
                    raise RuntimeError(f"GET /metrics: HTTP {r.status}")
                if "Accept-Encoding" in headers and r.getheader("Content-Encoding") != "gzip":
                    raise RuntimeError("GET /metrics: asked for gzip, got an uncompressed body")

            for _ in range(20):  # warm up
                get()
            c0 = server.cpu_seconds()
            results[key] = timed(get, before)
            results[key]["server_cpu_mean_ms"] = (server.cpu_seconds() - c0) / scrapes * 1000
            conn.close()
    return results


def report_scrape(scrape: dict[str, Any]) -> list[str]:
    lines = [
        f"scrape: {scrape['ranks']} ranks, {scrape['buffers']} buffers, "
        f"{scrape['series']} series, {scrape['exposition_bytes']} bytes per scrape"
    ]
    for key in SCRAPE_CASES:
        r = scrape[key]
        extra = (
            f"  server cpu mean {r['server_cpu_mean_ms']:.3f} ms"
            if "server_cpu_mean_ms" in r
            else ""
        )
        lines.append(
            f"  {key:24s} wall p50 {r['p50_ms']:7.3f} ms p99 {r['p99_ms']:7.3f} ms   "
            f"cpu p50 {r['cpu_p50_ms']:7.3f} ms p99 {r['cpu_p99_ms']:7.3f} ms{extra}  "
            f"(n={r['n']})"
        )
    for key, asked in (
        ("http_republished", "uncompressed"),
        ("http_republished_gzip", "gzip, as Prometheus asks"),
    ):
        lines.append(
            f"  target p99 <= 5 ms, GET over loopback with every rank republished ({asked}): "
            f"wall {'met' if scrape[key]['p99_ms'] <= 5 else 'NOT met'}"
        )
    lines.append(f"  in-process cpu p99 {scrape['in_process_republished']['cpu_p99_ms']:.3f} ms")
    return lines
