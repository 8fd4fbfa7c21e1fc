"""Part `concurrent` of `kvledger bench scrape`: keep-alive against fresh connections, and
many clients at once, over the published ranks served by `kvledger serve --no-demo`.

One client's scrape on a kept-alive connection against one on a new connection each time,
interleaved round by round (a keep-alive request must not wait for a delayed ACK); then
`--clients` keep-alive clients (`kvledger.tools.bench.loadgen`, a process of its own) scraping
back to back, or at one scrape each per interval, for `--concurrent-seconds` while every rank
republishes once a second and this process probes `/healthz` every 20 ms: errors, scrape
p50/p99, `/healthz` p99.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvledger.tools.bench.scrape_latency import percentile
from kvledger.tools.bench.scrape_ranks import rank_files
from kvledger.tools.bench.serve_child import ServeChild


def _stats(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "min_ms": min(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
    }


def _many_clients(
    server: ServeChild,
    host: str,
    port: int,
    republish: Callable[[], None],
    get: Callable[[Any, str], float],
    clients: int,
    seconds: float,
    interval: float,
) -> dict[str, Any]:
    """`clients` keep-alive clients (back to back, or one scrape each per `interval`) in a
    process of their own; ranks republish once a second (publishers at the default
    interval); /healthz probed from here every 20 ms."""
    import http.client

    stop = threading.Event()

    def republishing() -> None:
        while not stop.wait(1.0):
            republish()

    rep = threading.Thread(target=republishing, daemon=True)
    rep.start()
    load = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvledger.tools.bench.loadgen",
            "--host",
            host,
            "--port",
            str(port),
            "--clients",
            str(clients),
            "--seconds",
            str(seconds),
            "--interval",
            str(interval),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    health_ms: list[float] = []
    health_errors = 0
    probe = http.client.HTTPConnection(host, port, timeout=30)
    c0 = server.cpu_seconds()
    started = time.monotonic()
    try:
        time.sleep(min(1.0, seconds / 10))  # let the clients connect
        while load.poll() is None and time.monotonic() - started < seconds:
            try:
                health_ms.append(get(probe, "/healthz"))
            except (OSError, RuntimeError, http.client.HTTPException):
                health_errors += 1
                probe.close()
                probe = http.client.HTTPConnection(host, port, timeout=30)
            time.sleep(0.02)
        out, _ = load.communicate(timeout=seconds + 120)
    finally:
        stop.set()
        rep.join()
        if load.poll() is None:
            load.kill()
            load.wait()
        probe.close()
    loaded = json.loads(out)
    return {
        "clients": clients,
        "seconds": seconds,
        "interval": interval,
        "requests": loaded["requests"],
        "errors": loaded["errors"],
        "scrapes_per_second": loaded["requests"] / seconds,
        "scrape": _stats(loaded["latencies_ms"]),
        "healthz": _stats(health_ms),
        "healthz_errors": health_errors,
        "server_cpu_seconds": server.cpu_seconds() - c0,
    }


def bench_concurrent(
    ranks: int, budget: int, rounds: int, clients: int, seconds: float, intervals: tuple[float, ...]
) -> dict[str, Any]:
    import http.client

    from kvledger.tools.bench.loadgen import ACCEPT

    headers = {"Accept": ACCEPT, "Accept-Encoding": "gzip"}
    with contextlib.ExitStack() as stack:
        directory, _, republish = rank_files(stack, ranks, budget)
        server = stack.enter_context(
            ServeChild(
                ["--no-demo", "--port", "0", "--snapshot-dir", directory, "--log-interval", "3600"]
            )
        )
        host, port_text = server.url.split("//", 1)[1].rsplit(":", 1)
        port = int(port_text)

        def get(conn: http.client.HTTPConnection, path: str) -> float:
            t0 = time.perf_counter()
            conn.request("GET", path, headers=headers)
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {r.status}")
            return (time.perf_counter() - t0) * 1000

        # One client: a kept-alive connection against a new one per scrape, interleaved, the
        # order swapped every round. The fresh time includes the TCP handshake.
        kept = http.client.HTTPConnection(host, port, timeout=30)
        for _ in range(20):
            get(kept, "/metrics")
        keep_ms: list[float] = []
        fresh_ms: list[float] = []
        for i in range(rounds):
            for which in ("keep", "fresh") if i % 2 == 0 else ("fresh", "keep"):
                if which == "keep":
                    keep_ms.append(get(kept, "/metrics"))
                else:
                    conn = http.client.HTTPConnection(host, port, timeout=30)
                    fresh_ms.append(get(conn, "/metrics"))
                    conn.close()
        results: dict[str, Any] = {
            "one_client_keep_alive": _stats(keep_ms),
            "one_client_fresh_connection": _stats(fresh_ms),
        }

        for interval in intervals:
            results.setdefault("concurrent", []).append(
                _many_clients(server, host, port, republish, get, clients, seconds, interval)
            )
        kept.close()
    return results


def _line(name: str, st: dict[str, float]) -> str:
    if not st.get("n"):
        return f"  {name:28s} (no samples)"
    return (
        f"  {name:28s} p50 {st['p50_ms']:8.3f} ms  p99 {st['p99_ms']:8.3f} ms  "
        f"min {st['min_ms']:8.3f}  max {st['max_ms']:8.3f}  (n={st['n']})"
    )


def report_concurrent(c: dict[str, Any]) -> list[str]:
    keep, fresh = c["one_client_keep_alive"], c["one_client_fresh_connection"]
    diff = keep["p50_ms"] - fresh["p50_ms"]
    lines = [
        "one client, GET /metrics, interleaved round by round:",
        _line("keep-alive connection", keep),
        _line("new connection each time", fresh),
        f"  keep-alive p50 - fresh p50 = {diff:+.3f} ms; target <= +1 ms: "
        f"{'met' if diff <= 1 else 'NOT met'}",
    ]
    for many in c["concurrent"]:
        errors = sum(many["errors"].values()) + many["healthz_errors"]
        pace = (
            "back to back"
            if many["interval"] == 0
            else f"one scrape each per {many['interval']:g} s"
        )
        lines += [
            f"{many['clients']} keep-alive clients, {pace}, for {many['seconds']:g} s, every "
            f"rank republished each second: {many['requests']} scrapes "
            f"({many['scrapes_per_second']:.0f}/s), server cpu {many['server_cpu_seconds']:.1f} s",
            _line("scrape", many["scrape"]),
            _line("/healthz (every 20 ms)", many["healthz"]),
            f"  errors {errors} {many['errors'] or ''}; target 0: "
            f"{'met' if errors == 0 else 'NOT met'}; /healthz p99 target <= 50 ms: "
            f"{'met' if many['healthz'].get('p99_ms', 1e9) <= 50 else 'NOT met'}",
        ]
    return lines
