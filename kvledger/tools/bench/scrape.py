"""`kvledger bench scrape`: what the exporter costs, measured side by side in one run.

The command line and the order of the parts; each part is a module of its own, and all
but `overhead` scrape the same published ranks (`scrape_ranks`: 8 ranks x 43 layers x 7
families of DeepSeek-V4-Flash buffer maps, one published snapshot file per rank):

1. `scrape` (`scrape_latency`): scrape latency, the exposition built in-process and a full
   `GET /metrics` over loopback from `kvledger serve --no-demo` in its own process, with
   every file unchanged since the last scrape and with every rank republished before each
   scrape. Wall-clock and CPU: this process's per scrape, and the exporter process's mean.
2. `concurrent` (`scrape_concurrent`): keep-alive against fresh connections, one client,
   interleaved round by round; then `--clients` keep-alive clients at once for
   `--concurrent-seconds` while every rank republishes once a second and `/healthz` is
   probed every 20 ms: errors, scrape p50/p99, `/healthz` p99.
3. `overhead` (`overhead`): allocation-path overhead of accounting plus publishing, against
   the same allocator with no observer and with a second no-observer pool as the noise
   floor, block by block in one run.
4. `peer` (`scrape_peer`): the render against a peer, prometheus-client (the installed
   version), on the same series: kvledger's render of a republished scrape, `generate_latest`
   over plain Gauges, and `generate_latest` over a `MultiProcessCollector` merging one mmap
   file per rank (how SGLang serves its own /metrics); judged: kvledger/generate_latest <= 1.
5. `scale` (`scrape_scale`, only when asked for): the CPU of a republished scrape against
   the number of ranks (a fitted cost per rank), the served scrape's p99 while 64 ranks
   publish every 0.2 s, beside a control server from another tree (`--control-tree`), and
   the server's RSS after 1,000 sources came and went.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from accounting.snapfile.format import MAX_INTERVAL_S, MIN_INTERVAL_S
from exporter.server import malloc_exec
from kvledger.argtypes import number, one_line_errors, size
from kvledger.tools.bench.overhead import bench_overhead, report
from kvledger.tools.bench.scrape_concurrent import bench_concurrent, report_concurrent
from kvledger.tools.bench.scrape_latency import bench_scrape, report_scrape
from kvledger.tools.bench.scrape_peer import MULTIPROCESS_MODES, bench_peer, report_peer
from kvledger.tools.bench.scrape_scale import (
    SCALE_RANKS,
    bench_departed,
    bench_linear,
    bench_served,
    report_scale,
)

# scripts/scrape-ab and docs/benchmarks-history.md import `bench_scrape` from here, where
# part 1 lived before it had a module of its own.

PARTS = ("scrape", "concurrent", "overhead", "peer", "scale")
DEFAULT_PARTS = PARTS[:4]  # `scale` runs only when asked for (minutes)


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
        default=DEFAULT_PARTS,
        help="which parts to run, comma-separated, of scrape,concurrent,overhead,peer,scale "
        f"(default: {','.join(DEFAULT_PARTS)})",
    )
    p.add_argument(
        "--scale-ranks",
        type=_rank_counts,
        default=SCALE_RANKS,
        help="rank counts of the scale part's cost line, comma-separated "
        f"(default: {','.join(map(str, SCALE_RANKS))})",
    )
    p.add_argument(
        "--scale-served-ranks",
        type=number(int, 1, 256),
        default=64,
        help="ranks of the scale part's served run (default: %(default)s)",
    )
    p.add_argument(
        "--scale-publish-interval",
        type=number(float, 0.01, 60),
        default=0.2,
        help="seconds between rewrites of every rank in the served run (default: %(default)g)",
    )
    p.add_argument(
        "--scale-seconds",
        type=number(float, 0, 3600, lo_open=True),
        default=60.0,
        help="length of the served run (default: %(default)g)",
    )
    p.add_argument(
        "--scale-gap",
        type=number(float, 0, 60),
        default=0.05,
        help="seconds between the served run's scrapes (default: %(default)g)",
    )
    p.add_argument(
        "--scale-departed",
        type=number(int, 0, 1024),
        default=1000,
        help="sources planted and removed in the scale part's memory run, 0 for none "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--scale-departed-cycles",
        type=number(int, 1, 20),
        default=1,
        help="waves of new departed sources, one after the other (default: %(default)s)",
    )
    p.add_argument(
        "--scale-malloc",
        choices=malloc_exec.CHOICES,
        default="python",
        help="this tree's server's --malloc in the departed-sources run (default: %(default)s)",
    )
    p.add_argument(
        "--control-tree",
        type=_tree,
        default=None,
        help="a kvledger source tree (holding kvledger/ and exporter/) whose server runs "
        "beside this one in the served run, scraped in turn (default: none)",
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


def _rank_counts(text: str) -> tuple[int, ...]:
    parse = number(int, 1, 256)
    try:
        out = tuple(sorted({parse(x) for x in text.split(",")}))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if len(out) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected two or more rank counts")
    return out


def _tree(text: str) -> str:
    for part in ("kvledger", "exporter"):
        if not os.path.isfile(os.path.join(text, part, "__init__.py")):
            raise argparse.ArgumentTypeError(
                f"{text!r}: not a kvledger tree (no {part}/__init__.py in it)"
            )
    return os.path.abspath(text)


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes like 256,16,1") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes >= 1")
    return out


def run(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"pid": os.getpid()}
    if "scrape" in args.parts:
        out["scrape"] = bench_scrape(args.ranks, args.budget, args.scrapes)
        for line in report_scrape(out["scrape"]):
            print(line)
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
    if "scale" in args.parts:
        out["scale"] = {
            "linear": bench_linear(args.scale_ranks, args.budget, args.scrapes),
            "served": bench_served(
                args.scale_served_ranks,
                args.budget,
                args.scale_publish_interval,
                args.scale_seconds,
                args.scale_gap,
                args.control_tree,
            ),
        }
        if args.scale_departed:
            out["scale"]["departed"] = bench_departed(
                args.scale_departed,
                args.control_tree,
                args.scale_departed_cycles,
                args.scale_malloc,
            )
        for line in report_scale(out["scale"]):
            print(line)
    if args.json:
        print(json.dumps(out, indent=2))
    return 0
