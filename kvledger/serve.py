"""`kvledger serve`: the exporter over a snapshot directory, by default with an embedded demo source.

With no arguments it serves http://127.0.0.1:8000 and, in the same process, runs
the demo source (kvledger.demo: host backend, a DeepSeek-V4-Flash-shaped pool of
all seven families sized to a small budget, a built-in workload) publishing into
the snapshot directory, which any engine process may publish into too
(`accounting.publisher.Publisher`). `--no-demo` serves the directory alone.

One log line per `--log-interval`; Ctrl-C or SIGTERM stops the server, the
workload, the publisher (its file is removed) and the pool (nothing stays mapped),
and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

from accounting.units import format_size, parse_size
from kvledger.cli import UsageError

log = logging.getLogger("kvledger.serve")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _range(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` tokens."""
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a token count N or a range MIN:MAX"
        ) from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= MIN <= MAX")
    return a, b


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a value > 0")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger import demo

    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    net.add_argument(
        "--token",
        default=os.environ.get("KVLEDGER_TOKEN"),
        help="bearer token required by /debug/* (default: $KVLEDGER_TOKEN; none: open)",
    )
    net.add_argument(
        "--snapshot-dir",
        default=None,
        help=f"directory engines publish snapshots into (default {demo.default_snapshot_dir()})",
    )
    net.add_argument(
        "--stale-after",
        type=_positive(float),
        default=None,
        help="seconds before a silent source is stale (default: 3 publish intervals + 1 s)",
    )
    net.add_argument(
        "--forget-after",
        type=_positive(float),
        default=3600.0,
        help="seconds after which a stale source is no longer listed (default 3600)",
    )
    net.add_argument(
        "--log-interval", type=_positive(float), default=10.0, help="seconds between log lines"
    )
    src = p.add_argument_group("embedded demo source")
    src.add_argument("--no-demo", action="store_true", help="serve the snapshot directory only")
    src.add_argument("--backend", choices=("host", "cuda"), default="host")
    src.add_argument("--device", type=int, default=0, help="CUDA device (--backend cuda)")
    src.add_argument(
        "--config", default=None, help="HF config.json (default: DeepSeek-V4-Flash shape)"
    )
    src.add_argument(
        "--budget",
        type=_size,
        default=demo.DEFAULT_BUDGET,
        help=f"KV-cache byte budget to size the pool (default {format_size(demo.DEFAULT_BUDGET)})",
    )
    src.add_argument("--model-name", default="deepseek-v4-flash", help="model_name label")
    src.add_argument("--tp-rank", type=int, default=0, help="tp_rank label of the demo source")
    src.add_argument(
        "--max-running-requests", type=_positive(int), default=demo.DEFAULT_MAX_RUNNING
    )
    src.add_argument("--context-length", type=_positive(int), default=demo.DEFAULT_CONTEXT_LENGTH)
    src.add_argument(
        "--host-page-size",
        type=_size,
        default=demo.DEFAULT_HOST_GRANULARITY,
        help="host backend page (granularity) (default 256KiB)",
    )
    src.add_argument(
        "--interval", type=_positive(float), default=1.0, help="seconds between snapshots"
    )
    wl = p.add_argument_group("built-in workload")
    wl.add_argument("--rate", type=_positive(float), default=1.0, help="requests per second")
    wl.add_argument("--prompt-tokens", type=_range, default=(256, 2048), help="N or MIN:MAX")
    wl.add_argument("--output-tokens", type=_range, default=(64, 512), help="N or MIN:MAX")
    wl.add_argument(
        "--step-ms", type=_positive(float), default=20.0, help="milliseconds per decode step"
    )
    wl.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from exporter import html
    from exporter.app import create_app
    from exporter.sources import Sources
    from kvledger import demo as demo_mod
    from kvledger.workload import WorkloadConfig

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    snapshot_dir = args.snapshot_dir or demo_mod.default_snapshot_dir()
    sock = _bind(args.host, args.port)
    source: demo_mod.DemoSource | None = None
    try:
        if not args.no_demo:
            try:
                workload = WorkloadConfig(
                    rate=args.rate,
                    prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens,
                    step_seconds=args.step_ms / 1000,
                    max_running=args.max_running_requests,
                    seed=args.seed,
                )
                source = demo_mod.DemoSource(
                    demo_mod.DemoOptions(
                        config_path=args.config,
                        budget_bytes=args.budget,
                        backend=args.backend,
                        device=args.device,
                        host_granularity=args.host_page_size,
                        max_running_requests=args.max_running_requests,
                        context_length=args.context_length,
                        labels={"model_name": args.model_name, "tp_rank": str(args.tp_rank)},
                        snapshot_dir=snapshot_dir,
                        publish_interval=args.interval,
                        workload=workload,
                    )
                )
            except (ValueError, OSError) as e:
                raise UsageError(str(e)) from e
        sources = Sources(
            snapshot_dir, stale_after=args.stale_after, forget_after=args.forget_after
        )
        app = create_app(sources, token=args.token, debug_html=html.page)
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        )
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(
            f"kvledger serve: http://{shown}:{port}/metrics  (also /debug/kv, /healthz, /readyz; "
            f"snapshots in {snapshot_dir})",
            flush=True,
        )
        # Everything built so far lives as long as the process: out of the collector's way,
        # so a collection a scrape triggers walks only the scrape's young objects (with the
        # demo's torch loaded, a full collection over the rest took ~10 ms).
        gc.freeze()
        stop = threading.Event()
        _install_signal_handlers(server, stop)
        reporter = threading.Thread(
            target=_report, args=(sources, source, args.log_interval, stop), daemon=True
        )
        reporter.start()
        try:
            server.run(sockets=[sock])
        finally:
            stop.set()
            reporter.join()
    finally:
        if source is not None:
            source.close()
        sock.close()
    if source is not None:
        log.info("stopped: %s", closed_line(source))
    else:
        log.info("stopped")
    return 0


def closed_line(source: Any) -> str:
    """What the demo holds after close: VMM bytes and occupied slots must all be 0."""
    from accounting.buffers import Owner

    snap = source.ledger.snapshot(reconcile=False)
    vmm = [b for b in snap.buffers if b.spec.owner is Owner.VMM]
    return (
        f"vmm physical_bytes={sum(b.physical_bytes for b in vmm)} "
        f"mapped_bytes={sum(b.mapped_bytes for b in vmm)} "
        f"occupied_slots={snap.total('occupied_slots')} "
        f"snapshot file removed={not os.path.exists(source.publisher.path) if source.publisher else True}"
    )


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: expected 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot bind: {e.strerror}") from None
    # Listening from here on: a client that connects as soon as the URL is printed waits in
    # the backlog until uvicorn accepts, instead of being refused.
    sock.listen(socket.SOMAXCONN)
    sock.set_inheritable(False)
    return sock


def _install_signal_handlers(server: Any, stop: threading.Event) -> None:
    """SIGINT/SIGTERM end the server; cleanup runs after `server.run` returns.

    uvicorn installs its own handlers while it runs and, once shut down, raises the
    signals it caught again: these handlers receive them then, and only set flags.
    """

    def handle(sig: int, frame: FrameType | None) -> None:
        server.should_exit = True
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


def _report(sources: Any, source: Any, interval: float, stop: threading.Event) -> None:
    started = time.monotonic()
    while not stop.wait(interval):
        try:
            log.info("%s", status_line(sources, source, time.monotonic() - started))
        except Exception:
            log.exception("status line failed")


def status_line(sources: Any, source: Any, elapsed: float) -> str:
    """One line: sources, the workload, and per-figure totals across live sources."""
    views = sources.read()
    up = [v for v in views if v.up]
    totals = {"physical_bytes": 0, "mapped_bytes": 0, "occupied_bytes": 0}
    for v in up:
        for name in totals:
            totals[name] += v.snapshot.total(name)
    parts = [f"t={elapsed:.0f}s", f"sources {len(up)}/{len(views)} up"]
    if source is not None:
        s = source.workload.stats()
        swa = source.accounts["swa_kv"]
        parts.append(
            f"requests running {s['running']} waiting {s['waiting']} finished "
            f"{s.get('finished', 0)}"
        )
        parts.append(f"swa slots {swa.occupied_slots}/{swa.capacity_slots}")
    parts.append(
        "physical {} mapped {} occupied {} ({:.3f} GB)".format(
            format_size(totals["physical_bytes"]),
            format_size(totals["mapped_bytes"]),
            format_size(totals["occupied_bytes"]),
            totals["physical_bytes"] / 2**30,
        )
    )
    unattributed = [
        r.get("unattributed_bytes")
        for v in up
        for r in v.snapshot.reconciliation
        if r.get("unattributed_bytes") is not None
    ]
    if unattributed:
        parts.append(f"unattributed {sum(unattributed)} B")
    return " | ".join(parts)
