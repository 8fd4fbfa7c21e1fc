"""The scrape path: snapshot reads off the event loop, `/metrics` bodies built once per scan.

`SourceReader` runs `Sources.read()` in a worker thread, one scan at a time; a
request waits for a scan that starts after it arrived, and every request that
arrives while one runs shares the next (so 200 clients cost one scan, not 200).
`MetricsBodies` keeps the latest scan's bodies per format and encoding, each
rendered (and gzipped) once. `MetricsEndpoint` and `HealthEndpoint` are plain
ASGI apps: a scrape costs the event loop a dictionary lookup and two sends, not
a pass through the framework's request/response machinery, so `/healthz` does
not queue behind many scrapes (`kvledger bench scrape` measures both). Each is
declared once, in `exporter.app` (`AsgiRoute`), which documents it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio.to_thread

from exporter.collector import KvLedgerCollector
from exporter.compression import gzip_body
from exporter.exposition import content_type
from exporter.sources import Scan, Sources

log = logging.getLogger(__name__)


class ScanHook(Protocol):
    """Work done with each scan: `prepare` in the scan's worker thread, right after the
    read (no second hop to a thread); `install` in the event loop with its result."""

    def prepare(self, scan: Scan) -> Any: ...

    def install(self, generation: int, scan: Scan, prepared: Any) -> None: ...


class SourceReader:
    """`sources.read()` off the event loop, one scan at a time: a request waits for a scan
    that starts after it arrived, and every request that arrives while one runs shares
    the next. Returns (generation, scan); the generation numbers the scans. `hook`, when
    given, is run with every scan (`ScanHook`)."""

    def __init__(self, sources: Sources, hook: ScanHook | None = None) -> None:
        self.sources = sources
        self.hook = hook
        self.generation = 0
        self._pending: asyncio.Future[tuple[int, Scan]] | None = None
        self._running = False
        self._task: asyncio.Task[None] | None = None

    async def read(self) -> tuple[int, Scan]:
        fut = self._pending
        if fut is None:
            fut = self._pending = asyncio.get_running_loop().create_future()
            if not self._running:
                self._start()
        return await asyncio.shield(fut)

    def _start(self) -> None:
        fut, self._pending = self._pending, None
        assert fut is not None
        self._running = True
        # Held here: the event loop keeps only a weak reference to a task.
        self._task = asyncio.get_running_loop().create_task(self._scan(fut))

    def _read(self) -> tuple[Scan, Any]:
        scan = self.sources.read()
        return scan, (self.hook.prepare(scan) if self.hook is not None else None)

    async def _scan(self, fut: asyncio.Future[tuple[int, Scan]]) -> None:
        try:
            scan, prepared = await anyio.to_thread.run_sync(self._read)
        except Exception as e:
            fut.set_exception(e)
        else:
            self.generation += 1
            if self.hook is not None:
                self.hook.install(self.generation, scan, prepared)
            fut.set_result((self.generation, scan))
        finally:
            self._running = False
            if self._pending is not None:
                self._start()


def accepts_gzip(accept_encoding: str | None) -> bool:
    """True when `Accept-Encoding` lists gzip (or x-gzip) with a non-zero q."""
    for part in (accept_encoding or "").lower().split(","):
        coding, _, params = part.partition(";")
        if coding.strip() not in ("gzip", "x-gzip"):
            continue
        q = params.strip()
        if q.startswith("q="):
            try:
                return float(q[2:]) > 0
            except ValueError:
                return False
        return True
    return False


BodyKey = tuple[bool, bool]  # (OpenMetrics, gzip)
Body = tuple[bytes, str]  # (body, content type)
MAX_ACCEPTS = 64  # distinct Accept headers remembered
# A body asked for within this long is built with every scan; one nobody asked for since
# (a format somebody fetched once by hand) is built again only when asked. Longer than
# any scrape interval, so a scraper's body is always ready.
WANTED_S = 300.0


class ScanKey:
    """What a scan's exposition is built from, but the clock: each source's snapshot (the
    very object, which a file keeps while unchanged), whether it is up and why not, and
    the counts of what went wrong. Two scans with the same key differ in the ages of the
    snapshots only."""

    def __init__(self, published: tuple[object, ...], rest: tuple[object, ...]) -> None:
        self.published = published
        self.rest = rest

    @classmethod
    def of(cls, scan: Scan) -> ScanKey:
        files = scan.files
        views = tuple((v.up, v.last_error.reason if v.last_error else None) for v in scan.views)
        rest = (
            views,
            files.unreadable,
            files.directory_problem is None and files.write_problem is None,
            tuple(sorted(files.error_counts.items())),
            tuple(sorted(scan.source_errors.items())),
            tuple(sorted(scan.connections_closed.items())),
        )
        return cls(tuple(v.published for v in scan.views), rest)

    def same(self, scan: Scan) -> bool:
        other = ScanKey.of(scan)
        return (
            len(other.published) == len(self.published)
            and all(a is b for a, b in zip(other.published, self.published, strict=True))
            and other.rest == self.rest
        )


class MetricsBodies:
    """The latest scan's `/metrics` bodies, per format and encoding, each built once, in a
    worker thread (rendering and gzip stay out of the event loop too). A request that
    read an older scan gets the latest scan's body: it started after that request too.

    As the `ScanHook` of the `SourceReader`, the bodies asked for before are built in the
    scan's own worker thread, so a scrape costs one hop to a thread, shared by all the
    requests waiting for that scan. Only the bodies asked for in the last `WANTED_S`
    seconds are: a format fetched once is not rendered with every scan from then on."""

    def __init__(
        self, collector: KvLedgerCollector, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.collector = collector
        self._clock = clock
        self._generation = -1
        self._scan = Scan()
        self._bodies: dict[BodyKey, asyncio.Future[Body]] = {}
        # key -> (an Accept header that gives it, when it was last asked for)
        self._wanted: dict[BodyKey, tuple[str | None, float]] = {}
        self._keys: dict[str | None, bool] = {}  # Accept header -> OpenMetrics
        # Bodies built with the latest background scan, and what they were built from.
        self._ahead: tuple[ScanKey | None, dict[BodyKey, Body]] = (None, {})

    @property
    def wanted(self) -> list[BodyKey]:
        """The bodies built with every scan: those asked for in the last `WANTED_S` s."""
        since = self._clock() - WANTED_S
        return [key for key, (_, asked) in tuple(self._wanted.items()) if asked >= since]

    def prepare(self, scan: Scan) -> dict[BodyKey, Body]:
        key, bodies = self._ahead
        return self._prepare(scan, bodies if key is not None and key.same(scan) else {})

    def _prepare(self, scan: Scan, built: dict[BodyKey, Body]) -> dict[BodyKey, Body]:
        """The bodies asked for lately, those in `built` (for the same snapshots) taken."""
        out: dict[BodyKey, Body] = {}
        # `_wanted` holds at most the four keys and none is removed: a key asked for long ago
        # is only skipped here, and the request that asks for it again builds its body.
        # Uncompressed first, so that a format wanted both ways is rendered once.
        for key in sorted(self.wanted, key=lambda k: k[1]):
            accept = self._wanted[key][0]
            if key in built:
                out[key] = built[key]
                continue
            try:
                out[key] = self._build(scan, accept, key[1], out.get((key[0], False)))
            except Exception:  # the request that wants it builds it again, and fails alone
                log.exception("rendering /metrics failed")
        return out

    def ahead(self, scan: Scan) -> None:
        """Build the bodies asked for lately from a background scan (`Sources.after_scan`,
        in its thread) and keep them: a scrape whose own scan finds the same snapshots
        (`ScanKey`) is sent them as they are, rendering nothing. Their ages and counts are
        then those of the background scan, at most one scan interval old."""
        self._ahead = (ScanKey.of(scan), self._prepare(scan, {}))

    def install(self, generation: int, scan: Scan, prepared: Any) -> None:
        if generation <= self._generation:
            return
        self._generation, self._scan, self._bodies = generation, scan, {}
        loop = asyncio.get_running_loop()
        for key, body in prepared.items():
            fut = self._bodies[key] = loop.create_future()
            fut.set_result(body)

    def want(self, accept: str | None, gz: bool) -> BodyKey:
        """The body for `accept` (gzipped when `gz`) is asked for now: built with every scan
        for `WANTED_S` seconds."""
        openmetrics = self._keys.get(accept)
        if openmetrics is None:
            if len(self._keys) >= MAX_ACCEPTS:
                self._keys.clear()
            openmetrics = self._keys[accept] = content_type(accept)[0]
        key = (openmetrics, gz)
        self._wanted[key] = (accept, self._clock())
        return key

    async def get(self, generation: int, scan: Scan, accept: str | None, gz: bool) -> Body:
        if generation > self._generation:
            self._generation, self._scan, self._bodies = generation, scan, {}
        key = self.want(accept, gz)
        fut = self._bodies.get(key)
        if fut is None:
            fut = self._bodies[key] = asyncio.ensure_future(
                anyio.to_thread.run_sync(self._build, self._scan, accept, gz)
            )
        if fut.done():
            return fut.result()
        return await asyncio.shield(fut)

    def _build(
        self, scan: Scan, accept: str | None, gz: bool, rendered: Body | None = None
    ) -> Body:
        """The body for `accept` (and gzip when `gz`), from `rendered` when this scan's
        uncompressed body of the same format is at hand."""
        body, ctype = rendered if rendered is not None else self.collector.render(accept, scan)
        return (gzip_body(body) if gz else body), ctype


Scope = dict[str, Any]
Receive = Any
Send = Any


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class MetricsEndpoint:
    """GET /metrics as a plain ASGI app (documented by its `exporter.app.AsgiRoute`)."""

    __signature__ = inspect.Signature()  # no request parameters, for the OpenAPI schema

    def __init__(self, reader: SourceReader, bodies: MetricsBodies) -> None:
        self.reader = reader
        self.bodies = bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation, scan = await self.reader.read()
        gz = accepts_gzip(_header(scope, b"accept-encoding"))
        body, ctype = await self.bodies.get(generation, scan, _header(scope, b"accept"), gz)
        headers = [
            (b"content-type", ctype.encode()),
            (b"content-length", b"%d" % len(body)),
            (b"vary", b"Accept-Encoding"),
        ]
        if gz:
            headers.append((b"content-encoding", b"gzip"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )


class HealthEndpoint:
    """GET /healthz as a plain ASGI app: answered in the event loop at once."""

    __signature__ = inspect.Signature()  # no request parameters, for the OpenAPI schema

    BODY = b'{"status":"ok"}'
    HEADERS = (
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(BODY)),
    )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else self.BODY}
        )
