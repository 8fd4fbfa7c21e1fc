"""`kvledger bench scrape`: what the exporter costs, measured side by side in one run.

1. Scrape latency, 8 ranks x 43 layers x 7 families (DeepSeek-V4-Flash buffer maps, one
   published snapshot file per rank): the exposition built in-process (collector +
   text rendering), and a full `GET /metrics` over loopback from `kvledger serve
   --no-demo` in its own process (uvicorn; the exporter as deployed); once with every
   file unchanged since the last scrape (cache hits) and once with every rank
   republished before each scrape (8 files parsed again). Wall-clock and CPU: this
   process's per scrape, and the exporter process's mean from /proc.
2. Keep-alive against fresh connections, and many clients at once, over the same 8
   ranks served by `kvledger serve --no-demo`: one client's scrape on a kept-alive
   connection against one on a new connection each time, interleaved round by round
   (a keep-alive request must not wait for a delayed ACK); then `--clients` keep-alive
   clients (`kvledger.tools.bench.loadgen`, a process of its own) scraping back to back for
   `--concurrent-seconds` while every rank republishes once a second and this
   process probes `/healthz` every 20 ms: errors, scrape p50/p99, `/healthz` p99.
3. Allocation-path overhead of accounting plus publishing, against the same
   allocator with no observer and with a second no-observer pool as the noise
   floor, block by block in one run (`kvledger.tools.bench.overhead` says how).
4. The render against a peer, prometheus-client (the installed version), on the same
   series: kvledger's render of a republished scrape (the in-process case of part 1,
   written as text format 0.0.4 like the peer), `generate_latest` over a registry of
   plain Gauges holding the series kvledger rendered, and `generate_latest` over a
   `MultiProcessCollector` merging one mmap file per rank (how SGLang serves its own
   /metrics). Interleaved round by round, CPU of this process per render, the ratio
   kvledger/peer paired by round; judged: kvledger/generate_latest <= 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, cast, get_args

from accounting.buffers import Owner
from accounting.events import PoolEvent
from accounting.ledger import Ledger
from accounting.snapfile.directory import SnapshotDir
from accounting.snapfile.format import MAX_INTERVAL_S, MIN_INTERVAL_S
from accounting.snapfile.writer import Publisher
from kvledger.argtypes import number, one_line_errors, size
from kvledger.engines.sglang.dsv4 import Knobs, load_config, plan
from kvledger.tools.bench.loadgen import ACCEPT as PROMETHEUS_ACCEPT
from kvledger.tools.bench.overhead import bench_overhead, report
from kvledger.tools.bench.serve_child import ServeChild

GIB = 1 << 30


PARTS = ("scrape", "concurrent", "overhead", "peer")
# prometheus-client's Gauge multiprocess modes.
MultiprocessMode = Literal[
    "all",
    "liveall",
    "min",
    "livemin",
    "max",
    "livemax",
    "sum",
    "livesum",
    "mostrecent",
    "livemostrecent",
]
MULTIPROCESS_MODES: tuple[str, ...] = get_args(MultiprocessMode)
# What the scrape cases but the gzip one ask for: OpenMetrics, uncompressed.
PLAIN_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
SCRAPE_CASES = (
    "in_process_cached",
    "in_process_republished",
    "http_cached",
    "http_republished",
    "http_republished_gzip",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument(
        "--ranks", type=number(int, 1, 256), default=8, help="ranks served (default: %(default)s)"
    )
    p.add_argument(
        "--budget",
        type=size(1 << 20, 1 << 44),
        default=80 << 30,
        help="per-rank KV budget for the buffer maps (default: 80GiB)",
    )
    p.add_argument(
        "--scrapes",
        type=number(int, 1, 1_000_000),
        default=300,
        help="scrapes per scrape measurement, keep-alive/fresh rounds and rounds against "
        "prometheus-client (default: %(default)s)",
    )
    p.add_argument(
        "--clients",
        type=number(int, 1, 1000),
        default=200,
        help="keep-alive clients of the concurrent case (default: %(default)s)",
    )
    p.add_argument(
        "--concurrent-seconds",
        type=number(float, 0, 3600, lo_open=True),
        default=30.0,
        help="length of the concurrent case (default: %(default)g)",
    )
    p.add_argument(
        "--client-intervals",
        type=_intervals,
        default=(0.0, 1.0),
        help="seconds between one client's scrapes, one concurrent run each, 0 for back to "
        "back (default: 0,1)",
    )
    p.add_argument(
        "--parts",
        type=_parts,
        default=PARTS,
        help="which parts to run, comma-separated (default: scrape,concurrent,overhead,peer)",
    )
    p.add_argument(
        "--multiprocess-mode",
        choices=MULTIPROCESS_MODES,
        default="mostrecent",
        help="multiprocess_mode of the peer's per-rank gauges (default: %(default)s, as "
        "SGLang's gauges; the modes 'all' and 'liveall' add a pid label to every series)",
    )
    p.add_argument(
        "--batch",
        type=_batches,
        default=(256, 16, 1),
        help="slots per decode step (one per running request), comma-separated (default 256,16,1)",
    )
    p.add_argument(
        "--seconds",
        type=number(float, 0, 3600, lo_open=True),
        default=5.0,
        help="measured seconds per pool and batch size in the overhead run (default: %(default)g)",
    )
    p.add_argument(
        "--block-ms",
        type=number(float, 0, 10_000, lo_open=True),
        default=5.0,
        help="length of one block of decode steps; the pools take turns block by block "
        "(default: %(default)g)",
    )
    p.add_argument(
        "--publish-interval",
        type=number(float, MIN_INTERVAL_S, MAX_INTERVAL_S),
        default=1.0,
        help="publisher interval during the overhead run (default: %(default)g s, the "
        "Publisher default)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON too")


def _intervals(text: str) -> tuple[float, ...]:
    parse = number(float, 0, 3600)
    try:
        return tuple(parse(x) for x in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _parts(text: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in PARTS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected some of {','.join(PARTS)}")
    return out


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes like 256,16,1") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes >= 1")
    return out


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


# -- 1. scrape latency -------------------------------------------------------------------------
def rank_ledger(rank: int, budget: int) -> Ledger:
    """A DeepSeek-V4-Flash-shaped ledger for one rank with every figure non-zero."""
    from kvledger.demo.source import default_config_path

    shape = load_config(default_config_path())
    bm = plan(shape, Knobs(), budget_bytes=budget)
    ledger = Ledger({"model_name": "deepseek-v4-flash", "tp_rank": str(rank)})
    by_family: dict[str, list[Any]] = {}
    for s in bm.specs(pool="dsv4", owner_of={"swa_kv": Owner.VMM}):
        by_family.setdefault(s.family, []).append(s)
    for family, specs in by_family.items():
        vmm = family == "swa_kv"
        acc = ledger.add_account(specs, page_bytes=2 << 20 if vmm else 0)
        if vmm:
            acc.on_pool_event(PoolEvent.HANDLES_CREATED, 12)
            for _ in range(12):
                acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1, 0.0016)
            acc.on_pool_event(PoolEvent.PAGES_UNMAPPED, 2, 0.001)
        acc.occupy(min(acc.capacity_slots, 1000 + rank))
    return ledger


def _snapshot_versions(pub: Publisher, ledger: Ledger) -> tuple[bytes, bytes]:
    """Two different published files of one rank (the second one slot further on)."""
    versions = []
    for _ in range(2):
        pub.publish()
        with open(pub.path, "rb") as f:
            versions.append(f.read())
        next(a for a in ledger.accounts() if a.owner is Owner.RUNTIME).occupy(1)
    return versions[0], versions[1]


def _replace(path: str, data: bytes) -> None:
    """Write `data` to `path` the way a publisher does (accounting.snapfile.directory)."""
    with SnapshotDir(os.path.dirname(path), create=False) as d:
        d.write_replace(os.path.basename(path), data)


def _rank_files(
    stack: contextlib.ExitStack, ranks: int, budget: int
) -> tuple[str, int, Callable[[], None]]:
    """(directory, buffers, republish) for `ranks` published ranks, closed by `stack`.

    "Republished" = every rank's file replaced by a different snapshot. The bench writes
    snapshots encoded beforehand (as a publisher would: a new file, renamed into place), so
    that building them (~2 ms a rank) does not load the machine between scrapes; what
    publishing costs the engine is the overhead part's business."""
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-"))
    ledgers = [rank_ledger(r, budget) for r in range(ranks)]
    pubs = [
        stack.enter_context(Publisher(led, directory, interval=3600, source=f"rank{r}"))
        for r, led in enumerate(ledgers)
    ]
    buffers = sum(len(led.snapshot().buffers) for led in ledgers)
    versions = [_snapshot_versions(pub, led) for pub, led in zip(pubs, ledgers, strict=True)]
    turn = [0]

    def republish() -> None:
        turn[0] ^= 1
        for pub, v in zip(pubs, versions, strict=True):
            _replace(pub.path, v[turn[0]])

    republish()
    return directory, buffers, republish


def bench_scrape(ranks: int, budget: int, scrapes: int) -> dict[str, Any]:
    import http.client

    from exporter.collector import KvLedgerCollector
    from exporter.sources import Sources

    with contextlib.ExitStack() as stack:
        directory, buffers, republish = _rank_files(stack, ranks, budget)
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


# -- 2. keep-alive and many clients ----------------------------------------------------------
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
        directory, _, republish = _rank_files(stack, ranks, budget)
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


# -- 4. the render against prometheus-client's -----------------------------------------------
# The format prometheus-client's `generate_latest` writes; kvledger's render is asked for the
# same, so that the two write the same lines.
PEER_ACCEPT = "text/plain;version=0.0.4"
PEER_VARIANTS = ("kvledger", "generate_latest", "multiprocess")
PEER_TARGET_RATIO = 1.0  # kvledger/generate_latest, median of the ratios paired by round
# Which file a series goes to in the multiprocess peer: its rank's, by this label; a series
# without it (the exporter's own) goes to the first rank's file.
RANK_LABEL = "tp_rank"

# One series: (help text, sample name, label names, label values, value).
_Series = tuple[str, str, tuple[str, ...], tuple[str, ...], float]


def exposition_series(text: str) -> list[_Series]:
    """Every sample of a text-format-0.0.4 exposition, in order."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[_Series] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names = tuple(sample.labels)
            values = tuple(sample.labels[n] for n in names)
            out.append((family.documentation, sample.name, names, values, float(sample.value)))
    return out


def series_keys(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """(sample name, sorted labels) of every sample of a text-format-0.0.4 exposition."""
    return {
        (name, tuple(sorted(zip(ln, lv, strict=True))))
        for _, name, ln, lv, _ in exposition_series(text)
    }


def _set_gauges(
    series: list[_Series], registry: Any, multiprocess_mode: MultiprocessMode = "all"
) -> None:
    """One prometheus-client Gauge per sample name (a counter's `_total`, a histogram's
    `_bucket`, `_sum` and `_count` each a gauge of that name), every series of `series`
    set on it with its labels; registered in `registry` (None: in no registry)."""
    from prometheus_client import Gauge

    by_name: dict[str, tuple[str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]] = {}
    for doc, name, labelnames, labelvalues, value in series:
        entry = by_name.setdefault(name, (doc, tuple(sorted(labelnames)), []))
        if entry[1] != tuple(sorted(labelnames)):
            raise ValueError(f"{name}: label names {labelnames} and {entry[1]} in one exposition")
        labels = dict(zip(labelnames, labelvalues, strict=True))
        entry[2].append((tuple(labels[n] for n in entry[1]), value))
    for name, (doc, labelnames, rows) in by_name.items():
        gauge = Gauge(name, doc, labelnames, registry=registry, multiprocess_mode=multiprocess_mode)
        for values, value in rows:
            (gauge.labels(*values) if labelnames else gauge).set(value)


def _write_multiprocess_files(
    directory: str, series: list[_Series], ranks: list[str], multiprocess_mode: MultiprocessMode
) -> None:
    """Each rank's series written into its own mmap file in `directory`, as that rank's
    process would with PROMETHEUS_MULTIPROC_DIR set: values backed by
    `prometheus_client.values.MultiProcessValue` with the rank as process identifier.
    prometheus-client's global value class and the environment are restored after."""
    from prometheus_client import values

    owner = {rank: i for i, rank in enumerate(ranks)}
    per_rank: list[list[_Series]] = [[] for _ in ranks]
    for s in series:
        labels = dict(zip(s[2], s[3], strict=True))
        per_rank[owner.get(labels.get(RANK_LABEL, ""), 0)].append(s)
    saved_class, saved_env = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    try:
        for i, rank_series in enumerate(per_rank):
            values.ValueClass = values.MultiProcessValue(lambda i=i: i)
            _set_gauges(rank_series, None, multiprocess_mode)
    finally:
        values.ValueClass = saved_class
        if saved_env is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_env
        values.close_all_multiprocess_files()


@contextlib.contextmanager
def _torch_one_thread() -> Any:
    """torch pinned to one thread while it runs, where this process has loaded torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def _ms_stats(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def _ratio_stats(ratios: list[float]) -> dict[str, float]:
    return {
        "n": len(ratios),
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


def bench_peer(
    ranks: int, budget: int, rounds: int, multiprocess_mode: str = "mostrecent"
) -> dict[str, Any]:
    """kvledger's render of a republished scrape against prometheus-client's
    `generate_latest`, plain and multiprocess, on the same series, interleaved round by
    round (the order rotated every round); CPU of this process (and wall) per render."""
    from importlib.metadata import version

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from exporter.collector import KvLedgerCollector
    from exporter.sources import Sources

    if multiprocess_mode not in MULTIPROCESS_MODES:
        raise ValueError(
            f"bench_peer: multiprocess_mode={multiprocess_mode!r}, expected one of "
            f"{', '.join(MULTIPROCESS_MODES)}"
        )
    mode = cast(MultiprocessMode, multiprocess_mode)

    with contextlib.ExitStack() as stack:
        torch_threads = stack.enter_context(_torch_one_thread())
        directory, _, republish = _rank_files(stack, ranks, budget)
        sources = Sources(directory)
        renderer = KvLedgerCollector(sources)
        text = renderer.render(PEER_ACCEPT)[0].decode()
        series = exposition_series(text)
        ranks_seen = {
            labels[RANK_LABEL]
            for labels in (dict(zip(s[2], s[3], strict=True)) for s in series)
            if RANK_LABEL in labels
        }
        rank_values = sorted(ranks_seen, key=lambda v: (len(v), v)) or ["0"]
        plain = CollectorRegistry(auto_describe=False)
        _set_gauges(series, plain)
        mp_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-mp-"))
        _write_multiprocess_files(mp_dir, series, rank_values, mode)
        merged = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(merged, path=mp_dir)

        def kvledger() -> bytes:
            return renderer.render(PEER_ACCEPT)[0]

        render: dict[str, Callable[[], bytes]] = {
            "kvledger": kvledger,
            "generate_latest": lambda: generate_latest(plain),
            "multiprocess": lambda: generate_latest(merged),
        }
        keys = series_keys(text)
        out: dict[str, Any] = {
            "prometheus_client": version("prometheus_client"),
            "format": PEER_ACCEPT,
            "ranks": ranks,
            "rounds": rounds,
            "series": len(series),
            "multiprocess_files": len(os.listdir(mp_dir)),
            "multiprocess_mode": multiprocess_mode,
            "torch_threads": torch_threads,
        }
        for name in PEER_VARIANTS[1:]:
            peer_text = render[name]().decode()
            out[f"{name}_series"] = len(exposition_series(peer_text))
            out[f"{name}_same_series"] = series_keys(peer_text) == keys

        cpu: dict[str, list[float]] = {name: [] for name in PEER_VARIANTS}
        wall: dict[str, list[float]] = {name: [] for name in PEER_VARIANTS}
        warmup = min(10, rounds)
        parses = 0
        for i in range(warmup + rounds):
            if i == warmup:
                parses = sources.read().files.parses  # files unchanged since: parses none
            k = i % len(PEER_VARIANTS)
            for name in PEER_VARIANTS[k:] + PEER_VARIANTS[:k]:
                if name == "kvledger":
                    republish()  # every rank's file changed since kvledger's last render
                c0, t0 = time.process_time(), time.perf_counter()
                render[name]()
                t1, c1 = time.perf_counter(), time.process_time()
                if i >= warmup:
                    wall[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
        out["files_parsed_per_kvledger_render"] = (sources.read().files.parses - parses) / rounds
        for name in PEER_VARIANTS:
            out[name] = _ms_stats(cpu[name])
            out[name]["wall_median_ms"] = statistics.median(wall[name]) * 1000
        for name in PEER_VARIANTS[1:]:
            out[f"ratio_{name}"] = _ratio_stats(
                [k / max(p, 1e-9) for k, p in zip(cpu["kvledger"], cpu[name], strict=True)]
            )
        out["target_ratio"] = PEER_TARGET_RATIO
        out["target_met"] = out["ratio_generate_latest"]["median"] <= PEER_TARGET_RATIO
    return out


def report_peer(p: dict[str, Any]) -> list[str]:
    kv, gl, mp = (p[name] for name in PEER_VARIANTS)
    rg, rm = p["ratio_generate_latest"], p["ratio_multiprocess"]
    same = f"{p['generate_latest_series']}/{p['multiprocess_series']} series" + (
        ", the same names and labels"
        if p["generate_latest_same_series"] and p["multiprocess_same_series"]
        else ", NOT the same names and labels"
    )
    torch_note = "torch pinned to 1 thread" if p["torch_threads"] else "torch not loaded"
    lines = [
        f"render vs prometheus-client {p['prometheus_client']} (same {p['series']} series, "
        f"{p['ranks']} ranks): kvledger {kv['median_ms']:.3f} ms, generate_latest "
        f"{gl['median_ms']:.3f} ms, multiprocess {mp['median_ms']:.3f} ms; ratio "
        f"kvledger/generate_latest {rg['median']:.3f}, kvledger/multiprocess {rm['median']:.3f}",
        f"  CPU of this process per render, medians; {p['rounds']} rounds interleaved (order "
        f"rotated every round), every rank republished before kvledger's render; text format "
        f"0.0.4 all three; {torch_note}",
    ]
    for label, st in (
        ("kvledger render (republished)", kv),
        ("generate_latest (plain Gauges)", gl),
        (f"multiprocess ({p['multiprocess_files']} files, {p['multiprocess_mode']})", mp),
    ):
        lines.append(
            f"  {label:38s} median {st['median_ms']:8.3f} ms  min {st['min_ms']:8.3f}  "
            f"max {st['max_ms']:8.3f}  wall median {st['wall_median_ms']:8.3f}  (n={st['n']})"
        )
    for label, r in (("kvledger/generate_latest", rg), ("kvledger/multiprocess", rm)):
        lines.append(
            f"  ratio {label:30s} by round: median {r['median']:.3f}  min {r['min']:.3f}  "
            f"max {r['max']:.3f}  (n={r['n']})"
        )
    lines += [
        f"  peers rendered {same}; kvledger parsed "
        f"{p['files_parsed_per_kvledger_render']:g} files per render",
        f"  target kvledger/generate_latest <= {p['target_ratio']:g} (median of the paired "
        f"ratios): {'met' if p['target_met'] else 'NOT met'}",
    ]
    return lines


def run(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"pid": os.getpid()}
    if "scrape" in args.parts:
        scrape = out["scrape"] = bench_scrape(args.ranks, args.budget, args.scrapes)
        print(
            f"scrape: {scrape['ranks']} ranks, {scrape['buffers']} buffers, "
            f"{scrape['series']} series, {scrape['exposition_bytes']} bytes per scrape"
        )
        for key in SCRAPE_CASES:
            r = scrape[key]
            extra = (
                f"  server cpu mean {r['server_cpu_mean_ms']:.3f} ms"
                if "server_cpu_mean_ms" in r
                else ""
            )
            print(
                f"  {key:24s} wall p50 {r['p50_ms']:7.3f} ms p99 {r['p99_ms']:7.3f} ms   "
                f"cpu p50 {r['cpu_p50_ms']:7.3f} ms p99 {r['cpu_p99_ms']:7.3f} ms{extra}  "
                f"(n={r['n']})"
            )
        for key, asked in (
            ("http_republished", "uncompressed"),
            ("http_republished_gzip", "gzip, as Prometheus asks"),
        ):
            print(
                f"  target p99 <= 5 ms, GET over loopback with every rank republished ({asked}): "
                f"wall {'met' if scrape[key]['p99_ms'] <= 5 else 'NOT met'}"
            )
        print(f"  in-process cpu p99 {scrape['in_process_republished']['cpu_p99_ms']:.3f} ms")
    if "concurrent" in args.parts:
        out["concurrent"] = bench_concurrent(
            args.ranks,
            args.budget,
            args.scrapes,
            args.clients,
            args.concurrent_seconds,
            args.client_intervals,
        )
        for line in report_concurrent(out["concurrent"]):
            print(line)
    if "overhead" in args.parts:
        out["overhead"] = []
        for batch in args.batch:
            over = bench_overhead(
                batch=batch,
                seconds=args.seconds,
                publish_interval=args.publish_interval,
                block_ms=args.block_ms,
            )
            out["overhead"].append(over)
            for line in report(over):
                print(line)
    if "peer" in args.parts:
        out["peer"] = bench_peer(args.ranks, args.budget, args.scrapes, args.multiprocess_mode)
        for line in report_peer(out["peer"]):
            print(line)
    if args.json:
        print(json.dumps(out, indent=2))
    return 0
