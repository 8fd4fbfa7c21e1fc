"""Where a republished scrape's time and tail are: the scan thread against the rest of a GET.

    python -m kvledger.bench.scrape_tail [--ranks 8] [--scrapes 300] [--rounds 4]
                                         [--variants default,gc-off,h11,inline,pinned]

The republished case of `kvledger bench scrape` (every rank's file replaced before each
GET, `kvledger serve --no-demo --scan-interval 0`), with the server watched from inside: a
`sitecustomize` in a private directory on the server's `PYTHONPATH` (this tool's only; the
product has no such hook) times each `SourceReader._read` (the scan thread's read of the
files and its render of the bodies) in wall and thread CPU time and records every collection
of the cyclic garbage collector, and writes them out when the server stops. Per run it
prints the GET's p50 and p99, the scan's wall and CPU p50 and p99, the rest of a GET
beside the scan (HTTP, the hops to the worker thread and back, the client) at the median
and in the slowest 5 %, and the collections' time; then each figure's median [min, max]
over the runs of each variant. Variants, interleaved round by round with the order
reversed every other round: `default` (the server as shipped), `gc-off` (automatic
garbage collection off in the server), `h11` (the connection guards on uvicorn's h11
protocol instead of httptools), `inline` (the scan and render run on the event loop's
thread instead of a worker thread: no hop there and back), `pinned` (the server's threads
on one CPU, the last it may use, so the scan never changes cores). docs/benchmarks.md
quotes it in "Round 6" (its first form) and "Round 7" (the last two variants).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from kvledger.argtypes import number, one_line_errors

VARIANTS = {
    "default": {},
    "gc-off": {"KVLEDGER_TAIL_GC_OFF": "1"},
    "h11": {"KVLEDGER_TAIL_H11": "1"},
    "inline": {"KVLEDGER_TAIL_INLINE": "1"},
    "pinned": {"KVLEDGER_TAIL_PINNED": "1"},
}

# Loaded by the server's interpreter at start (PYTHONPATH): times the scan thread's work
# and the collector's, and writes them to $KVLEDGER_TAIL_OUT at exit.
_SITECUSTOMIZE = """
import atexit, gc, json, os, time
_out = os.environ.get("KVLEDGER_TAIL_OUT")
if _out:
    if os.environ.get("KVLEDGER_TAIL_GC_OFF"):
        gc.disable()
    if os.environ.get("KVLEDGER_TAIL_H11"):
        import exporter.connections as _c
        _c.guarded_protocol = _c.guarded_h11
    if os.environ.get("KVLEDGER_TAIL_PINNED"):  # threads made later inherit it
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    _ev = {"gc": [], "scan": []}
    _t0 = [0.0]
    def _gc(phase, info):
        now = time.perf_counter()
        if phase == "start":
            _t0[0] = now
        else:
            _ev["gc"].append((now, info["generation"], now - _t0[0]))
    gc.callbacks.append(_gc)
    import exporter.serving as _s
    _read = _s.SourceReader._read
    import threading
    def _timed(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return _read(self)
        finally:
            _ev["scan"].append((
                t0,
                time.perf_counter() - t0,
                time.thread_time() - c0,
                threading.current_thread() is threading.main_thread(),
                len(os.sched_getaffinity(0)),
            ))
    _s.SourceReader._read = _timed
    if os.environ.get("KVLEDGER_TAIL_INLINE"):  # the scan on the event loop, no thread hop
        import anyio.to_thread as _tt
        _run_sync = _tt.run_sync
        async def _inline(fn, *args, **kwargs):
            if getattr(fn, "__name__", "") == "_timed":
                return fn(*args)
            return await _run_sync(fn, *args, **kwargs)
        _tt.run_sync = _inline
    def _dump():
        with open(_out, "x") as f:
            json.dump(_ev, f)
    atexit.register(_dump)
"""


def _variants(text: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in VARIANTS]
    if not out or bad or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected distinct names of {','.join(VARIANTS)}"
        )
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.scrape_tail", description=__doc__)
    one_line_errors(p)
    p.add_argument("--ranks", type=number(int, 1, 64), default=8, help="ranks (default: 8)")
    p.add_argument(
        "--scrapes", type=number(int, 10, 100_000), default=300, help="GETs per run (default: 300)"
    )
    p.add_argument("--rounds", type=number(int, 1, 100), default=4, help="rounds (default: 4)")
    p.add_argument(
        "--variants",
        type=_variants,
        default=tuple(VARIANTS),
        help=f"comma-separated, of {','.join(VARIANTS)} (default: all)",
    )
    return p


def one_run(
    directory: str, republish: Any, variant: str, scrapes: int, private: str, out: str
) -> dict[str, Any]:
    """One server of `variant`, `scrapes` republished GETs, its events written to `out` (a
    new name in the directory `private`, whose `sitecustomize` it loads); its figures in
    milliseconds."""
    import kvledger
    from kvledger.bench.scrape import PLAIN_ACCEPT, percentile
    from kvledger.bench.serve_child import ServeChild

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvledger.__file__)))
    path = os.pathsep.join(p for p in (root, private, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "KVLEDGER_TAIL_OUT": out, **VARIANTS[variant]}
    args = ["--no-demo", "--port", "0", "--snapshot-dir", directory, "--log-interval", "3600"]
    spans: list[tuple[float, float]] = []
    with ServeChild([*args, "--scan-interval", "0"], env=env) as server:
        host, port = server.url.split("//", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            for i in range(20 + scrapes):  # 20 to warm up
                republish()
                t0 = time.perf_counter()
                conn.request("GET", "/metrics", headers={"Accept": PLAIN_ACCEPT})
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    raise RuntimeError(f"GET /metrics: HTTP {r.status}")
                if i >= 20:
                    spans.append((t0, time.perf_counter()))
        finally:
            conn.close()
    with open(out) as f:
        events = json.load(f)
    start = spans[0][0]
    scans = [s for s in events["scan"] if s[0] >= start]
    gcs = [g for g in events["gc"] if g[0] >= start]
    rows = []  # per GET: its wall, and the scan wall inside it
    for a, b in spans:
        inside = sum(s[1] for s in scans if a <= s[0] <= b)
        rows.append(((b - a) * 1e3, inside * 1e3))
    rows.sort()
    tail = rows[-max(3, len(rows) // 20) :]
    walls = [r[0] for r in rows]
    scan_wall = [s[1] * 1e3 for s in scans]
    scan_cpu = [s[2] * 1e3 for s in scans]
    return {
        "get_p50": statistics.median(walls),
        "get_p99": percentile(walls, 99),
        "scan_wall_p50": statistics.median(scan_wall),
        "scan_wall_p99": percentile(scan_wall, 99),
        "scan_cpu_p50": statistics.median(scan_cpu),
        "scan_cpu_p99": percentile(scan_cpu, 99),
        "rest_p50": statistics.median(r[0] - r[1] for r in rows),
        "rest_slowest_5pct": statistics.mean(r[0] - r[1] for r in tail),
        "gc_ms": sum(g[2] for g in gcs) * 1e3,
        "gc_collections": len(gcs),
        "scans": len(scans),
        "scans_on_main_thread": sum(1 for s in scans if s[3]),  # the event loop's (inline)
        "scan_cpus_max": max(s[4] for s in scans),  # CPUs the scan thread may run on
    }


def run(args: argparse.Namespace, out: Any = sys.stdout) -> dict[str, list[dict[str, Any]]]:
    from kvledger.bench.scrape import _rank_files

    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    with contextlib.ExitStack() as stack:
        private = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-tail-"))
        with open(os.path.join(private, "sitecustomize.py"), "x") as f:
            f.write(_SITECUSTOMIZE)
        directory, _, republish = _rank_files(stack, args.ranks, 80 << 30)
        for r in range(args.rounds):
            order = args.variants if r % 2 == 0 else args.variants[::-1]
            for v in order:
                events = os.path.join(private, f"events-{r}-{v}.json")
                rec = one_run(directory, republish, v, args.scrapes, private, events)
                results[v].append(rec)
                shown = " ".join(f"{k} {x:.2f}" for k, x in rec.items() if isinstance(x, float))
                print(f"round {r + 1} {v}: {shown}", file=out, flush=True)
    print("median [min, max] over the runs, milliseconds:", file=out)
    for v, recs in results.items():
        cells = []
        for key, value in recs[0].items():
            if isinstance(value, float):
                xs = [x[key] for x in recs]
                cells.append(f"{key} {statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]")
        print(f"  {v}: " + " | ".join(cells), file=out)
    return results


def main(argv: list[str] | None = None) -> int:
    run(parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
