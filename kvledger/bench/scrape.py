"""`kvledger bench scrape`: what the exporter costs, measured side by side in one run.

1. Scrape latency, 8 ranks x 43 layers x 7 families (DeepSeek-V4-Flash buffer maps, one
   published snapshot file per rank): the exposition built in-process (collector +
   text rendering), and a full `GET /metrics` over loopback from `kvledger serve
   --no-demo` in its own process (uvicorn; the exporter as deployed); once with every
   file unchanged since the last scrape (cache hits) and once with every rank
   republished before each scrape (8 files parsed again). Wall-clock and CPU: this
   process's per scrape, and the exporter process's mean from /proc.
2. Allocation-path overhead of accounting plus publishing, against the same
   allocator with no observer and with a second no-observer pool as the noise
   floor, block by block in one run (`kvledger.bench.overhead` says how).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from accounting.buffers import Owner
from accounting.dsv4 import Knobs, load_config, plan
from accounting.events import PoolEvent
from accounting.ledger import Ledger
from accounting.publisher import Publisher
from kvledger.bench.overhead import bench_overhead, report
from kvledger.serve_process import ServeProcess

GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--budget", default="80GiB", help="per-rank KV budget for the buffer maps")
    p.add_argument("--scrapes", type=int, default=300, help="scrapes per scrape measurement")
    p.add_argument(
        "--batch",
        type=_batches,
        default=(256, 16, 1),
        help="slots per decode step (one per running request), comma-separated (default 256,16,1)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="measured seconds per pool and batch size in the overhead run (default 5)",
    )
    p.add_argument(
        "--block-ms",
        type=float,
        default=5.0,
        help="length of one block of decode steps; the pools take turns block by block",
    )
    p.add_argument(
        "--publish-interval",
        type=float,
        default=1.0,
        help="publisher interval during the overhead run (default 1 s, the Publisher default)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON too")


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes like 256,16,1") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes >= 1")
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "max_ms": max(ms), "n": len(ms)}


# -- 1. scrape latency -------------------------------------------------------------------------
def rank_ledger(rank: int, budget: int) -> Ledger:
    """A DeepSeek-V4-Flash-shaped ledger for one rank with every figure non-zero."""
    from kvledger.demo import default_config_path

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
    """Write `data` to `path` the way a publisher does: a temporary file, then a rename."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def bench_scrape(ranks: int, budget: int, scrapes: int) -> dict[str, Any]:
    import http.client

    from exporter.collector import KvLedgerCollector
    from exporter.sources import Sources

    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-"))
        ledgers = [rank_ledger(r, budget) for r in range(ranks)]
        pubs = [
            stack.enter_context(Publisher(led, directory, interval=3600, source=f"rank{r}"))
            for r, led in enumerate(ledgers)
        ]
        buffers = sum(len(led.snapshot().buffers) for led in ledgers)
        # "Republished" = every rank's file replaced by a different snapshot before a scrape.
        # The bench writes snapshots encoded beforehand (as a publisher would: temporary file,
        # rename), so that building them (~2 ms a rank) does not load the machine between
        # scrapes; what publishing costs the engine is the overhead part's business.
        versions = [_snapshot_versions(pub, led) for pub, led in zip(pubs, ledgers, strict=True)]
        turn = [0]

        def republish() -> None:
            turn[0] ^= 1
            for pub, v in zip(pubs, versions, strict=True):
                _replace(pub.path, v[turn[0]])

        republish()
        sources = Sources(directory)
        renderer = KvLedgerCollector(sources)  # what GET /metrics calls
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
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
        parses = sources.parses
        results["in_process_republished"] = timed(lambda: renderer.render(accept), republish)
        results["files_parsed_per_republished_scrape"] = (sources.parses - parses) / scrapes

        server = stack.enter_context(
            ServeProcess(
                ["--no-demo", "--port", "0", "--snapshot-dir", directory, "--log-interval", "3600"]
            )
        )
        host, port = server.url.split("//", 1)[1].rsplit(":", 1)
        for key, before in (("http_cached", None), ("http_republished", republish)):
            # One keep-alive connection per case, as a scraper keeps one per target; the
            # standard library's client, whose own cost per request is a fraction of httpx's.
            conn = http.client.HTTPConnection(host, int(port), timeout=10)

            def get(conn: http.client.HTTPConnection = conn) -> None:
                conn.request("GET", "/metrics", headers={"Accept": accept})
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    raise RuntimeError(f"GET /metrics: HTTP {r.status}")

            for _ in range(20):  # warm up
                get()
            c0 = server.cpu_seconds()
            results[key] = timed(get, before)
            results[key]["server_cpu_mean_ms"] = (server.cpu_seconds() - c0) / scrapes * 1000
            conn.close()
    return results


def run(args: argparse.Namespace) -> int:
    from accounting.units import parse_size

    budget = parse_size(args.budget)
    scrape = bench_scrape(args.ranks, budget, args.scrapes)
    print(
        f"scrape: {scrape['ranks']} ranks, {scrape['buffers']} buffers, {scrape['series']} series, "
        f"{scrape['exposition_bytes']} bytes per scrape"
    )
    for key in ("in_process_cached", "in_process_republished", "http_cached", "http_republished"):
        r = scrape[key]
        extra = (
            f"  server cpu mean {r['server_cpu_mean_ms']:.3f} ms"
            if "server_cpu_mean_ms" in r
            else ""
        )
        print(
            f"  {key:24s} wall p50 {r['p50_ms']:7.3f} ms p99 {r['p99_ms']:7.3f} ms   "
            f"cpu p50 {r['cpu_p50_ms']:7.3f} ms p99 {r['cpu_p99_ms']:7.3f} ms{extra}  (n={r['n']})"
        )
    worst = scrape["http_republished"]
    print(
        f"  target p99 <= 5 ms, GET over loopback with every rank republished: wall "
        f"{'met' if worst['p99_ms'] <= 5 else 'NOT met'}; in-process cpu p99 "
        f"{scrape['in_process_republished']['cpu_p99_ms']:.3f} ms"
    )
    overheads = []
    for batch in args.batch:
        over = bench_overhead(
            batch=batch,
            seconds=args.seconds,
            publish_interval=args.publish_interval,
            block_ms=args.block_ms,
        )
        overheads.append(over)
        for line in report(over):
            print(line)
    if args.json:
        print(json.dumps({"scrape": scrape, "overhead": overheads, "pid": os.getpid()}, indent=2))
    return 0
