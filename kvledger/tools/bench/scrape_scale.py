"""Part `scale` of `kvledger bench scrape`: what a scrape costs as ranks are added, and the
served scrape's tail while many ranks publish fast.

1. Cost against ranks: one published directory per rank count (`--scale-ranks`, default
   1,8,16,32,64,128), every rank republished before each scrape, and the scrape built
   in-process (`Sources.read` + `KvLedgerCollector.render`, the work a `GET /metrics`
   did in its worker thread before background scans built the bodies ahead), every
   changed file parsed (the per-scan cap of 64 parses lifted for 128 ranks). The counts take turns round by round, in an order rotated
   every round, so a noisy stretch of the machine lands on all of them. CPU of this
   process per scrape (median, min, max, n), and a least-squares line through the
   medians: the cost per rank (slope) and the fixed cost (intercept), with the largest
   distance of a median from that line. Beside it, in the same rounds, what a scrape
   itself costs as `kvledger serve` runs it, with the background scan's bodies at hand
   (`MetricsBodies.ahead`): the rank files republished after that scan, the scrape's own
   scan (a listing and an `lstat` each), the snapshots compared and the body taken, and a
   line through those medians too.
2. Served tail: `--scale-served-ranks` ranks (default 64) rewritten every
   `--scale-publish-interval` s (default 0.2) by a process of their own, served by
   `kvledger serve --no-demo` as deployed (background scanning on), one keep-alive client
   scraping as Prometheus asks (gzip) with `--scale-gap` s between rounds for
   `--scale-seconds`. With `--control-tree DIR` a second server runs from that kvledger
   tree (an older commit, say) over the same directory, and the client scrapes the two
   in turn, the order swapped every round: both see the same files and the same load.
   p50, p99, max, n and errors per server, and each server's RSS at the end.
3. Departed sources: `--scale-departed` snapshot files of distinct sources (1,000) planted
   beside one live publisher, scraped (`/metrics` plain and gzipped OpenMetrics,
   `/debug/kv`) for 8 s, removed, and scraped for 25 s more; each server's RSS (this
   tree's, and the control's when given, one after the other) at the start, at the peak
   and at the end; with `--scale-departed-cycles N`, N waves of new sources one after the
   other, each wave's peak and end (whether what stays after one wave serves the next).
"""

from __future__ import annotations

import contextlib
import http.client
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvledger.tools.bench.loadgen import ACCEPT as PROMETHEUS_ACCEPT
from kvledger.tools.bench.scrape_latency import percentile
from kvledger.tools.bench.scrape_ranks import rank_files
from kvledger.tools.bench.serve_child import ServeChild

SCALE_RANKS = (1, 8, 16, 32, 64, 128)


def _spread(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "p99_ms": percentile(ms, 99),
    }


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(slope, intercept, largest |residual|) of the least-squares line through (xs, ys)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"fit_line: need two or more distinct x values, got {list(xs)}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    worst = max(abs(y - (slope * x + intercept)) for x, y in zip(xs, ys, strict=True))
    return slope, intercept, worst


def bench_linear(rank_counts: Sequence[int], budget: int, rounds: int) -> dict[str, Any]:
    """In-process scrape cost per rank count, every rank republished before each scrape."""
    from exporter.collector import KvLedgerCollector
    from exporter.serving import MetricsBodies
    from exporter.sources import Sources

    accept = "text/plain;version=0.0.4"
    counts = sorted(set(rank_counts))
    with contextlib.ExitStack() as stack:
        cases = []
        for ranks in counts:
            directory, _, republish = rank_files(stack, ranks, budget)
            sources = stack.enter_context(Sources(directory))
            assert sources.files is not None
            # Every republished file parsed by the scrape that follows (a scan parses at most
            # 64 changed files, MAX_PARSES, and serves the older version of the rest).
            sources.files.max_parses = ranks
            collector = KvLedgerCollector(sources)
            body, _ = collector.render(accept, sources.read())
            # The same files as `kvledger serve` serves them: scanned and rendered in the
            # background, the scrape's own scan and body taken from there.
            ahead_sources = stack.enter_context(Sources(directory))
            assert ahead_sources.files is not None
            ahead_sources.files.max_parses = ranks
            ahead_sources._keep_young = 3600.0  # as if the background scan just ran
            bodies = MetricsBodies(KvLedgerCollector(ahead_sources))
            bodies.want(PROMETHEUS_ACCEPT, True)
            cases.append((ranks, sources, collector, republish, len(body), ahead_sources, bodies))
        cpu: dict[int, list[float]] = {r: [] for r in counts}
        wall: dict[int, list[float]] = {r: [] for r in counts}
        ahead: dict[int, list[float]] = {r: [] for r in counts}
        for i in range(rounds + 3):  # the first three rounds warm up
            shift = i % len(cases)
            for ranks, sources, collector, republish, _, ahead_sources, bodies in (
                cases[shift:] + cases[:shift]
            ):
                republish()
                c0, t0 = time.process_time(), time.perf_counter()
                collector.render(accept, sources.read())
                if i >= 3:
                    wall[ranks].append(time.perf_counter() - t0)
                    cpu[ranks].append(time.process_time() - c0)
                bodies.ahead(ahead_sources._read(0.0))  # the background scan's work
                republish()  # published again since: the scrape keeps the versions parsed
                c0 = time.process_time()
                built = bodies.prepare(ahead_sources.read())
                if i >= 3:
                    ahead[ranks].append(time.process_time() - c0)
                if not built:
                    raise RuntimeError("bench scale: no body built ahead")
        per: dict[int, dict[str, Any]] = {
            r: {
                "cpu": _spread(cpu[r]),
                "wall": _spread(wall[r]),
                "ahead_cpu": _spread(ahead[r]),
                "bytes": b,
            }
            for r, _, _, _, b, _, _ in cases
        }
    slope, intercept, worst = fit_line(counts, [per[r]["cpu"]["median_ms"] for r in counts])
    a_slope, a_intercept, a_worst = fit_line(
        counts, [per[r]["ahead_cpu"]["median_ms"] for r in counts]
    )
    return {
        "ahead_slope_ms_per_rank": a_slope,
        "ahead_intercept_ms": a_intercept,
        "ahead_worst_residual_ms": a_worst,
        "rounds": rounds,
        "per_ranks": per,
        "slope_ms_per_rank": slope,
        "intercept_ms": intercept,
        "worst_residual_ms": worst,
    }


def _republishing(
    paths_versions: list[tuple[str, bytes, bytes]], interval: float, stop: Any
) -> None:
    """Rewrite every rank's file every `interval` s (a process of its own)."""
    from accounting.snapfile.directory import SnapshotDir

    with SnapshotDir(os.path.dirname(paths_versions[0][0]), create=False) as d:
        turn = 0
        next_at = time.monotonic()
        while not stop.is_set():
            turn ^= 1
            for path, a, b in paths_versions:
                d.write_replace(os.path.basename(path), a if turn else b)
            next_at += interval
            stop.wait(max(0.0, next_at - time.monotonic()))


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def bench_served(
    ranks: int,
    budget: int,
    publish_interval: float,
    seconds: float,
    gap: float,
    control_tree: str | None,
) -> dict[str, Any]:
    headers = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
    ctx = multiprocessing.get_context("fork")
    with contextlib.ExitStack() as stack:
        directory, _, _ = rank_files(stack, ranks, budget)
        versions = []
        for name in sorted(os.listdir(directory)):
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                data = f.read()
            versions.append((path, data, data))  # a new inode each write: parsed again
        args = ["--no-demo", "--port", "0", "--snapshot-dir", directory, "--log-interval", "3600"]
        # this tree with scrapes served from the background scan's work (`--scrape-max-age`,
        # off by default: a scrape then parses what changed, as the control does)
        ahead = [*args, "--scrape-max-age", "0.5"]
        servers: dict[str, ServeChild] = {"this tree": stack.enter_context(ServeChild(ahead))}
        if control_tree is not None:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(control_tree)}
            servers["control"] = stack.enter_context(
                ServeChild(args, env=env, cwd=os.path.abspath(control_tree))
            )
        conns = {}
        for key, server in servers.items():
            host, port = server.url.split("//", 1)[1].rsplit(":", 1)
            conns[key] = http.client.HTTPConnection(host, int(port), timeout=30)
            stack.callback(conns[key].close)
        stop = ctx.Event()
        writer = ctx.Process(
            target=_republishing, args=(versions, publish_interval, stop), daemon=True
        )
        writer.start()

        def finish() -> None:
            stop.set()
            writer.join(10)
            if writer.is_alive():
                writer.kill()

        stack.callback(finish)
        lat: dict[str, list[float]] = {k: [] for k in servers}
        errors: dict[str, int] = {k: 0 for k in servers}
        order = list(servers)
        time.sleep(1.0)  # the servers' first scans
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < seconds:
            for key in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                try:
                    conns[key].request("GET", "/metrics", headers=headers)
                    r = conns[key].getresponse()
                    r.read()
                    ok = r.status == 200
                except (OSError, http.client.HTTPException):
                    ok = False
                    conns[key].close()
                if ok:
                    lat[key].append(time.perf_counter() - t0)
                else:
                    errors[key] += 1
                time.sleep(gap)
            i += 1
        out = {
            key: {
                "scrape": _spread(lat[key]) if lat[key] else {"n": 0},
                "errors": errors[key],
                "rss_kib": _rss_kib(servers[key].proc.pid),
            }
            for key in servers
        }
    return {
        "ranks": ranks,
        "publish_interval": publish_interval,
        "seconds": seconds,
        "gap": gap,
        "control_tree": control_tree,
        "servers": out,
    }


def _departed_once(
    count: int, tree: str | None, cycles: int = 1, malloc: str = "python"
) -> dict[str, Any]:
    import json
    import tempfile

    from accounting.ledger import Ledger
    from accounting.snapfile.format import parse
    from accounting.snapfile.writer import Publisher

    with contextlib.ExitStack() as stack:
        d = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "snap")
        args = ["--no-demo", "--port", "0", "--snapshot-dir", d, "--log-interval", "3600"]
        if malloc != "python":  # this tree only: a control tree may predate the flag
            args += ["--malloc", malloc]
        env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
        server = stack.enter_context(ServeChild(args, env=env, cwd=tree))
        pub = stack.enter_context(
            Publisher(Ledger({"model_name": "live", "tp_rank": "0"}), d, interval=0.5)
        )
        host, port = server.url.split("//", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        stack.callback(conn.close)

        def get(path: str, headers: dict[str, str] | None = None) -> bytes:
            conn.request("GET", path, headers=headers or {})
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {r.status}")
            return body

        def scrape_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                get("/metrics")
                get("/metrics", {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
                get("/debug/kv")
                time.sleep(0.2)

        deadline = time.monotonic() + 30
        while b'model_name="live"' not in get("/metrics"):
            if time.monotonic() > deadline:
                raise RuntimeError("bench scale: the live source never showed")
            time.sleep(0.1)
        scrape_for(4)
        base = _rss_kib(server.proc.pid)
        with open(pub.path, "rb") as f:
            envelope, rows = parse(f.read())
        peaks, afters = [], []
        for cycle in range(cycles):  # new sources each cycle: nothing of the last is reused
            names = [f"gone{cycle}-{i}" for i in range(count)]
            for i, name in enumerate(names):
                labels = {"model_name": f"m{cycle}-{i}", "tp_rank": "0"}
                doc = {
                    **envelope,
                    "source": name,
                    "snapshot": {**envelope["snapshot"], "labels": labels},
                }
                with open(os.path.join(d, f"{name}.json"), "wb") as out:
                    out.write(json.dumps(doc).encode() + b"\n" + rows)
            scrape_for(8)
            peaks.append(_rss_kib(server.proc.pid) / 1024)
            for name in names:
                os.unlink(os.path.join(d, f"{name}.json"))
            scrape_for(25)
            afters.append(_rss_kib(server.proc.pid) / 1024)
    return {
        "base_mib": base / 1024,
        "peaks_mib": peaks,
        "afters_mib": afters,
    }


def bench_departed(
    count: int, control_tree: str | None, cycles: int = 1, malloc: str = "python"
) -> dict[str, Any]:
    """RSS of `kvledger serve` before, with and after `count` sources, `cycles` times over
    with new sources each time (this tree's server with `--malloc malloc`, then the control
    tree's when given)."""
    servers = {"this tree": _departed_once(count, None, cycles, malloc)}
    if control_tree is not None:
        servers["control"] = _departed_once(count, os.path.abspath(control_tree), cycles)
    return {"sources": count, "cycles": cycles, "malloc": malloc, "servers": servers}


def report_scale(scale: dict[str, Any]) -> list[str]:
    lines = []
    linear = scale.get("linear")
    if linear is not None:
        lines.append(
            f"scale: CPU per scrape (Sources.read + render, every rank republished before each "
            f"scrape), rank counts interleaved, {linear['rounds']} rounds:"
        )
        for r, st in linear["per_ranks"].items():
            c = st["cpu"]
            lines.append(
                f"  {int(r):4d} ranks  median {c['median_ms']:8.3f} ms  min {c['min_ms']:8.3f}  "
                f"max {c['max_ms']:8.3f}  (n={c['n']})  wall median "
                f"{st['wall']['median_ms']:8.3f} ms  {st['bytes']} bytes"
            )
        lines.append(
            f"  fit through the medians: {linear['slope_ms_per_rank']:.4f} ms per rank + "
            f"{linear['intercept_ms']:.3f} ms; largest distance of a median from the line "
            f"{linear['worst_residual_ms']:.3f} ms"
        )
        lines.append(
            "  a scrape's own CPU with the bodies built by the background scan (its scan, "
            "the snapshots compared, the gzip body taken), every rank published again since:"
        )
        for r, st in linear["per_ranks"].items():
            c = st["ahead_cpu"]
            lines.append(
                f"  {int(r):4d} ranks  median {c['median_ms']:8.3f} ms  min {c['min_ms']:8.3f}  "
                f"max {c['max_ms']:8.3f}  (n={c['n']})"
            )
        lines.append(
            f"  fit through the medians: {linear['ahead_slope_ms_per_rank']:.4f} ms per rank + "
            f"{linear['ahead_intercept_ms']:.3f} ms; largest distance of a median from the "
            f"line {linear['ahead_worst_residual_ms']:.3f} ms"
        )
    departed = scale.get("departed")
    if departed is not None:
        lines.append(
            f"departed: {departed['sources']} sources planted, served 8 s, removed, "
            "served 25 s more; RSS of each server (this tree's allocator: "
            f"{departed.get('malloc', 'python')})"
        )
        for key, m in departed["servers"].items():
            peak, after = m["peaks_mib"][0], m["afters_mib"][0]  # the first wave's
            ratio = after / m["base_mib"]
            lines.append(
                f"  {key:10s} start {m['base_mib']:6.1f} MiB  peak {peak:6.1f}  "
                f"after {after:6.1f}  after/start {ratio:.3f}  target <= 1.2: "
                f"{'met' if ratio <= 1.2 else 'NOT met'}"
            )
            if len(m["afters_mib"]) > 1:
                # Does memory that stays after one wave serve the next, or add to it?
                lines.append(
                    f"  {'':10s} each of {len(m['afters_mib'])} waves of new sources: peak "
                    + " ".join(f"{x:.1f}" for x in m["peaks_mib"])
                    + " MiB, after "
                    + " ".join(f"{x:.1f}" for x in m["afters_mib"])
                    + f"; last after / first after {m['afters_mib'][-1] / m['afters_mib'][0]:.3f}"
                )
    served = scale.get("served")
    if served is not None:
        lines.append(
            f"served: {served['ranks']} ranks rewritten every {served['publish_interval']:g} s, "
            f"GET /metrics (gzip) every {served['gap']:g} s for {served['seconds']:g} s"
            + (
                f", alternating with a control server from {served['control_tree']}"
                if served["control_tree"]
                else ""
            )
        )
        for key, st in served["servers"].items():
            s = st["scrape"]
            if not s.get("n"):
                lines.append(f"  {key:10s} no successful scrape; errors {st['errors']}")
                continue
            lines.append(
                f"  {key:10s} p50 {s['median_ms']:8.3f} ms  p99 {s['p99_ms']:8.3f} ms  "
                f"min {s['min_ms']:8.3f}  max {s['max_ms']:8.3f}  (n={s['n']})  errors "
                f"{st['errors']}  RSS {st['rss_kib'] / 1024:.1f} MiB"
            )
        this = served["servers"]["this tree"]["scrape"]
        if this.get("n"):
            lines.append(
                f"  target p99 < 50 ms (this tree): {'met' if this['p99_ms'] < 50 else 'NOT met'}"
            )
    return lines
