"""The exporter's HTTP server: the app over its sources, behind the connection guard and
basic auth where configured, served by uvicorn on a socket bound beforehand, until SIGINT
or SIGTERM.

The caller builds the sources (a snapshot directory's, and whatever publishes into it) and
hands them over with the checked settings (`listen.bind`, `connections.limits_from`,
`webconfig.for_server`); nothing here knows an engine or a demo.
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from exporter.server import connections as conn
from exporter.server import lograte
from exporter.server.webconfig import WebConfig

log = logging.getLogger("kvledger.serve")


@dataclass(frozen=True)
class Settings:
    """What the server needs beside its sources, each checked already."""

    sock: socket.socket  # bound and listening (listen.bind)
    limits: conn.Limits  # connections.limits_from
    web: WebConfig  # TLS and basic auth (an empty WebConfig: neither)
    token: str | None  # the bearer token of /debug/*, or None
    log_limit: lograte.RateLimit
    log_interval: float  # seconds between status lines
    status: Callable[[float], str]  # the status line after that many seconds


def serve(
    sources: Any, settings: Settings, *, where: str, before_ready: Callable[[], None]
) -> None:
    """Serve `sources` (read from the snapshot directory `where`) until SIGINT or SIGTERM. `before_ready` runs once everything is built
    and before the URL is printed (a start-up signal whose exception was swallowed ends the
    start-up there); the socket stays the caller's to close."""
    import uvicorn

    from exporter import html
    from exporter.app import create_app
    from exporter.server.basicauth import BasicAuth

    web = settings.web
    app: Any = create_app(sources, token=settings.token, debug_html=html.page)
    if web.users:
        app = BasicAuth(app, web.users)
    # TLS is the guard's (its handshake counted and timed from the TCP accept), not uvicorn's.
    guard = conn.ConnectionGuard(settings.limits, tls=web.tls)
    sources.connection_counts = guard.closed.copy
    sources.connections_gone = guard.connections_gone
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        http=conn.guarded_protocol(guard),
        **settings.limits.uvicorn_settings(),
    )
    lograte.install(settings.log_limit)  # uvicorn's handlers exist once its Config is made
    server = uvicorn.Server(config)
    before_ready()
    host, port = settings.sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"kvledger serve: {web.scheme}://{shown}:{port}/metrics  (also /debug/kv, /healthz, /readyz; "
        f"snapshots in {where})",
        flush=True,
    )
    # Everything built so far lives as long as the process: out of the collector's way,
    # so a collection a scrape triggers walks only the scrape's young objects (with the
    # demo's torch loaded, a full collection over the rest took ~10 ms).
    gc.freeze()
    stop = threading.Event()
    _install_signal_handlers(server, stop)
    reporter = threading.Thread(
        target=_report, args=(settings.status, settings.log_interval, stop), daemon=True
    )
    reporter.start()
    try:
        server.run(sockets=[settings.sock])
    finally:
        stop.set()
        reporter.join()


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


def _report(status: Callable[[float], str], interval: float, stop: threading.Event) -> None:
    started = time.monotonic()
    while not stop.wait(interval):
        try:
            log.info("%s", status(time.monotonic() - started))
        except Exception:
            log.exception("status line failed")
