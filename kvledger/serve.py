"""`kvledger serve`: the exporter over a snapshot directory, by default with an embedded demo source.

With no arguments it serves http://127.0.0.1:8000 and, in the same process, runs
the demo source (kvledger.demo.source: host backend, a DeepSeek-V4-Flash-shaped pool of
all seven families sized to a small budget, a built-in workload) publishing into
the snapshot directory, which any engine process may publish into too
(`accounting.publisher.Publisher`). `--no-demo` serves the directory alone.

On the host backend a `--budget` whose pool does not fit the machine's available
memory is refused before anything is allocated; while the pool is built a progress
line is logged every second. One log line per `--log-interval`; Ctrl-C or SIGTERM,
during start-up as well as while serving, stops the server, the workload, the
publisher (its file is removed) and the pool (nothing stays mapped), and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import secrets
import sys
from typing import TYPE_CHECKING, Any

from accounting.units import format_size
from exporter.server.errors import UsageError
from kvledger.serve_flags import add_arguments  # the command's flags (kvledger.cli)

if TYPE_CHECKING:
    from exporter.server.startup import StartUp

__all__ = ["add_arguments", "closed_line", "run", "status_line"]

log = logging.getLogger("kvledger.serve")


def run(args: argparse.Namespace) -> int:
    from exporter.server.startup import StartupStopped, taken_over

    _choose_malloc(getattr(args, "malloc", "python"))
    try:
        with taken_over() as start_up:
            return _serve(args, start_up)
    except StartupStopped as e:
        print(f"kvledger serve: stopped by {e} during start-up", file=sys.stderr, flush=True)
        return 0


def _choose_malloc(choice: str) -> None:
    """`--malloc jemalloc`: start this command again with jemalloc preloaded (once: the
    second start only checks it took). Refused, in one line, where no trusted library is
    found or kvledger was not started as a command."""
    from exporter.server import malloc_exec as mx

    if choice != "jemalloc":
        return
    if mx.second_start():
        preloaded = os.environ.get("LD_PRELOAD", "").split(":")[0]
        if not mx.loaded(preloaded):
            print(
                f"kvledger serve: --malloc jemalloc: {preloaded} is not mapped in this process "
                "(LD_PRELOAD ignored?); serving with it unconfirmed",
                file=sys.stderr,
                flush=True,
            )
        return
    from exporter.server import early_signals

    if early_signals.received():
        return  # a Ctrl-C already came: the start-up stops as it would (taken_over)
    found, why = mx.find_jemalloc()
    if found is None:
        raise UsageError(
            "--malloc jemalloc: no trusted jemalloc library ("
            + "; ".join(why)
            + "); install it (Debian: apt-get install libjemalloc2) or use --malloc python"
        )
    if not mx.launched_as_command():
        raise UsageError(
            "--malloc jemalloc needs kvledger serve started as a command (kvledger or "
            "python -m kvledger), which it starts again with the library preloaded"
        )
    mx.reexec(found)


def _serve(args: argparse.Namespace, start_up: StartUp) -> int:
    from accounting.snapfile.directory import default_snapshot_dir
    from exporter.server import connections as conn
    from exporter.server import lograte
    from exporter.server.listen import bind, is_loopback
    from exporter.server.run import Settings, serve
    from exporter.server.startup import signals_deferred
    from exporter.server.token import ARGV_REFUSED, TokenError, load_token
    from exporter.server.webconfig import FLAG, for_server
    from exporter.sources import Sources
    from kvledger.demo import source as demo_mod
    from kvledger.demo.workload import WorkloadConfig
    from kvledger.engines.exports import register_all

    register_all()  # every engine's sources served in its own shape (exporter.engines)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    log_limit = lograte.RateLimit()
    lograte.install(log_limit)
    if args.token is not None:
        raise UsageError(ARGV_REFUSED)
    try:
        token = load_token(args.token_file)
    except TokenError as e:
        raise UsageError(str(e)) from None
    web = for_server(args.web_config_file, token)
    snapshot_dir = args.snapshot_dir or default_snapshot_dir()
    group = args.snapshot_dir_group_writable
    soft, _ = conn.raise_fd_limit()
    limits = conn.limits_from(
        args.max_connections,
        header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        request_timeout=args.request_timeout,
        keep_alive=args.keep_alive,
        soft_limit=soft,
        in_use=conn.open_fds(),
        error=UsageError,
    )
    sock = bind(
        args.host,
        args.port,
        token=token is not None or bool(web.users),
        insecure_no_token=args.insecure_no_token,
    )
    if web.users and web.tls is None and not is_loopback(sock.getsockname()):
        log.warning(
            "%s %s: basic auth without tls_server_config: passwords cross the network in the clear",
            FLAG,
            web.path,
        )
    if not args.no_demo:
        with signals_deferred():  # a signal inside numpy's import would break it for good
            import torch  # noqa: F401  (the demo's pool is torch tensors)
    start_up.check()  # after the imports (numpy's among them, where a signal was lost)
    source: demo_mod.DemoSource | None = None
    sources: Sources | None = None
    try:
        try:
            sources = Sources(
                snapshot_dir,
                stale_after=args.stale_after,
                forget_after=args.forget_after,
                create=True,
                group_writable=group,
                temp_grace=args.temp_grace,
            )
        except (ValueError, OSError) as e:
            raise UsageError(_one_line(e)) from None
        if args.scan_interval > 0:
            sources.start_scanning(args.scan_interval, args.scrape_max_age)
        if not args.no_demo:
            # The demo publishes there: a directory that passes the rules but takes no file
            # (/proc/1, a read-only mount) is refused now, not retried by the publisher forever.
            _check_writable(snapshot_dir, group)
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
                        snapshot_dir_group_writable=group,
                        publish_interval=args.interval,
                        workload=workload,
                    )
                )
            except (ValueError, OSError, RuntimeError, AssertionError) as e:
                # Bad input, and driver or OS errors at start (no GPU, no CUDA build, a
                # driver refusal, out of memory): one line, exit 2.
                raise UsageError(_one_line(e)) from None
        settings = Settings(
            sock=sock,
            limits=limits,
            web=web,
            token=token,
            log_limit=log_limit,
            log_interval=args.log_interval,
            status=functools.partial(status_line, sources, source),
        )
        # A start-up signal whose exception was swallowed (in the demo's build, say) ends it
        # before the URL says the server is up; one that comes after this raises where it
        # lands (nothing below swallows it) until the server's own handlers take over.
        serve(sources, settings, where=snapshot_dir, before_ready=start_up.check)
    finally:
        if source is not None:
            source.close()
        if sources is not None:
            sources.close()
        sock.close()
    if source is not None:
        log.info("stopped: %s", closed_line(source))
    else:
        log.info("stopped")
    return 0


def _check_writable(path: str, group_writable: bool) -> None:
    """UsageError (one line) unless a file can be created in the snapshot directory."""
    from accounting.snapfile.directory import SnapshotDir, SnapshotDirError

    name = f".kvledger-serve-probe-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with SnapshotDir(path, create=True, group_writable=group_writable) as d:
            os.close(os.open(name, flags, 0o600, dir_fd=d.fd))
            os.unlink(name, dir_fd=d.fd)
    except (OSError, SnapshotDirError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else _one_line(e)
        raise UsageError(
            f"--snapshot-dir {path}: cannot create a snapshot file there ({why}); expected a "
            "directory this user can write"
        ) from None


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


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {text}"


def status_line(sources: Any, source: Any, elapsed: float) -> str:
    """One line: sources, the workload, and per-figure totals across live sources."""
    from kvledger.engines.vllm import views as vllm_views  # exporter-side: no vLLM import

    views = sources.read().views
    up = [v for v in views if v.up]
    # A vLLM engine core's figures are blocks (its bytes are its workers'): said in blocks.
    vllm_cores = [v for v in up if vllm_views.role(v.summary.labels) == vllm_views.SCHEDULER]
    others = [v for v in up if vllm_views.role(v.summary.labels) is None]
    physical = sum(v.summary.totals.physical_bytes for v in up)
    mapped = sum(v.summary.totals.mapped_bytes for v in up)
    occupied = sum(v.summary.totals.occupied_bytes for v in others)
    parts = [f"t={elapsed:.0f}s", f"sources {len(up)}/{len(views)} up"]
    if source is not None:
        s = source.workload.stats()
        swa = source.accounts["swa_kv"]
        parts.append(
            f"requests running {s['running']} waiting {s['waiting']} finished "
            f"{s.get('finished', 0)}"
        )
        parts.append(f"swa slots {swa.occupied_slots}/{swa.capacity_slots}")
    # Each figure right after its own value, in its own unit; the headline gauge is the
    # physical figure in GiB, named as such (never a decimal "GB" after a binary figure).
    headline = (
        f"(sglang:kv_cache_memory_usage_gb {physical / 2**30:.3f} GiB) "
        if others or not vllm_cores
        else ""
    )
    parts.append(f"physical {format_size(physical)} {headline}mapped {format_size(mapped)}")
    if others or not vllm_cores:
        parts.append(f"occupied {format_size(occupied)}")
    for v in vllm_cores:
        e = vllm_views.engine_view(v.summary)
        parts.append(
            f"vllm {v.summary.labels.get('model_name', '?')}/{v.summary.labels.get('engine', '0')} "
            f"blocks occupied {e.occupied_blocks}/{e.blocks} evictable {e.evictable_blocks}"
        )
    unattributed = [
        r.unattributed_bytes
        for v in up
        for r in v.summary.reconciliation
        if r.unattributed_bytes is not None
    ]
    if unattributed:
        total = sum(unattributed)
        parts.append(f"unattributed {'-' if total < 0 else ''}{format_size(abs(total))}")
    return " | ".join(parts)
