"""The scrape path: snapshot reads off the event loop, `/metrics` bodies built once per scan.

`SourceReader` runs `Sources.read()` in a worker thread, one scan at a time; a
request waits for a scan that starts after it arrived, and every request that
arrives while one runs shares the next (so 200 clients cost one scan, not 200).
`MetricsBodies` keeps the latest scan's bodies per format and encoding, each
rendered (and gzipped) once. `MetricsEndpoint` and `HealthEndpoint` are plain
ASGI apps: a scrape costs the event loop a dictionary lookup and two sends, not
a pass through the framework's request/response machinery, so `/healthz` does
not queue behind many scrapes (`kvledger bench scrape` measures both).
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from exporter.collector import KvLedgerCollector
from exporter.exposition import content_type
from exporter.sources import Sources, SourceView

GZIP_LEVEL = 6  # one rank's 19.7 KB body is ~2.9 KB; done once per scan, not per request


class SourceReader:
    """`sources.read()` off the event loop, one scan at a time: a request waits for a scan
    that starts after it arrived, and every request that arrives while one runs shares
    the next. Returns (generation, views); the generation numbers the scans."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self.generation = 0
        self._pending: asyncio.Future[tuple[int, list[SourceView]]] | None = None
        self._running = False
        self._task: asyncio.Task[None] | None = None

    async def read(self) -> tuple[int, list[SourceView]]:
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

    async def _scan(self, fut: asyncio.Future[tuple[int, list[SourceView]]]) -> None:
        try:
            views = await anyio.to_thread.run_sync(self.sources.read)
        except Exception as e:
            fut.set_exception(e)
        else:
            self.generation += 1
            fut.set_result((self.generation, views))
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


class MetricsBodies:
    """The latest scan's `/metrics` bodies, per format and encoding, each built once, in a
    worker thread (rendering and gzip stay out of the event loop too). A request that
    read an older scan gets the latest scan's body: it started after that request too."""

    def __init__(self, collector: KvLedgerCollector) -> None:
        self.collector = collector
        self._generation = -1
        self._views: Sequence[SourceView] = ()
        self._bodies: dict[tuple[bool, bool], asyncio.Future[tuple[bytes, str]]] = {}

    async def get(
        self, generation: int, views: Sequence[SourceView], accept: str | None, gz: bool
    ) -> tuple[bytes, str]:
        if generation > self._generation:
            self._generation, self._views, self._bodies = generation, views, {}
        key = (content_type(accept)[0], gz)
        fut = self._bodies.get(key)
        if fut is None:
            fut = self._bodies[key] = asyncio.ensure_future(
                anyio.to_thread.run_sync(self._build, self._views, accept, gz)
            )
        return await asyncio.shield(fut)

    def _build(
        self, views: Sequence[SourceView], accept: str | None, gz: bool
    ) -> tuple[bytes, str]:
        body, ctype = self.collector.render(accept, views)
        return (gzip.compress(body, GZIP_LEVEL, mtime=0) if gz else body), ctype


Scope = dict[str, Any]
Receive = Any
Send = Any


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class MetricsEndpoint:
    """GET /metrics as a plain ASGI app (the route's documentation stays with FastAPI)."""

    def __init__(self, reader: SourceReader, bodies: MetricsBodies) -> None:
        self.reader = reader
        self.bodies = bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation, views = await self.reader.read()
        gz = accepts_gzip(_header(scope, b"accept-encoding"))
        body, ctype = await self.bodies.get(generation, views, _header(scope, b"accept"), gz)
        headers = [
            (b"content-type", ctype.encode()),
            (b"content-length", str(len(body)).encode()),
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

    BODY = b'{"status":"ok"}'

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.BODY)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else self.BODY}
        )
