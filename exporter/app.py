"""The FastAPI app: `/metrics`, `/debug/kv`, `/healthz`, `/readyz`.

`create_app(sources)` builds a standalone app (what `kvledger serve` runs);
`create_router(sources)` gives the same routes to include in an engine's own
FastAPI app, and the app itself can be mounted (`parent.mount("/kvledger", app)`)
for a single-process engine that serves its ledger in-process
(`Sources().add_ledger(ledger)`). Each app has its own prometheus-client
registry; nothing is global.

With a `token`, `/debug/*` requires `Authorization: Bearer <token>`; `/metrics`
and the health endpoints stay open, as Prometheus and probes expect.

Nothing that touches the snapshot directory runs in the event loop: reads go
through `exporter.serving.SourceReader` (one scan at a time in a worker thread;
requests that arrive while a scan runs share the next one), so `/healthz` answers
at once whatever the directory holds. `/metrics` bodies are rendered once per scan
and format, and gzipped (once) for a client that sends `Accept-Encoding: gzip`;
`/metrics` and `/healthz` are served by plain ASGI apps (exporter.serving).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.routing import Route

from exporter import debug
from exporter.collector import KvLedgerCollector
from exporter.serving import HealthEndpoint, MetricsBodies, MetricsEndpoint, SourceReader
from exporter.sources import Sources

DEBUG_PARAMS = ("family", "rank", "layer")


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    sources: int
    up: int


class Problem(BaseModel):
    detail: str
    param: str | None = None


def _auth_dependency(token: str | None) -> Callable[..., None]:
    bearer = HTTPBearer(
        auto_error=False,
        description="the token of `kvledger serve --token-file FILE` (or $KVLEDGER_TOKEN)",
    )

    def check(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if token is None:
            return
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token for /debug/*",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


DebugHtml = Callable[[debug.DebugKv], str]


def wants_html(accept: str | None) -> bool:
    """True when a browser asks: text/html listed before application/json (or json absent)."""
    media = [p.split(";")[0].strip().lower() for p in (accept or "").split(",")]
    if "text/html" not in media:
        return False
    return "application/json" not in media or media.index("text/html") < media.index(
        "application/json"
    )


def create_router(
    sources: Sources, *, token: str | None = None, debug_html: DebugHtml | None = None
) -> APIRouter:
    """The routes. `debug_html`, when given, renders `/debug/kv` for a browser (Accept:
    text/html) from the same `DebugKv` document the JSON carries."""
    collector = KvLedgerCollector(sources)
    reader = SourceReader(sources)
    bodies = MetricsBodies(collector)
    router = APIRouter()
    auth = _auth_dependency(token)

    @router.get(
        "/metrics",
        response_class=Response,
        summary="Prometheus exposition built from one snapshot per source",
        responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}},
    )
    async def metrics(request: Request) -> Response:  # documents the route; served below
        raise AssertionError("served by exporter.serving.MetricsEndpoint")

    @router.get(
        "/debug/kv",
        response_model=debug.DebugKv,
        summary="The ledger's snapshots: buffer map, figures, relations, reconciliation",
        dependencies=[Depends(auth)],
        responses={
            200: {"content": {"text/html": {}}},
            400: {"model": Problem},
            401: {"model": Problem},
        },
    )
    async def debug_kv(
        request: Request,
        family: Annotated[
            str | None,
            Query(
                min_length=1,
                max_length=64,
                pattern=r"^[A-Za-z0-9_]+$",
                description="keep one buffer family (e.g. swa_kv)",
            ),
        ] = None,
        rank: Annotated[
            int | None, Query(ge=0, le=1_000_000, description="keep the sources of one tp_rank")
        ] = None,
        layer: Annotated[
            int | None, Query(ge=0, le=1_000_000, description="keep one layer's buffers")
        ] = None,
    ) -> debug.DebugKv | JSONResponse | HTMLResponse:
        unknown = sorted(set(request.query_params) - set(DEBUG_PARAMS))
        if unknown:
            return _problem(
                unknown[0],
                f"unknown query parameter {unknown[0]!r}; expected one of {', '.join(DEBUG_PARAMS)}",
            )
        _, views = await reader.read()

        def build() -> debug.DebugKv:
            doc = debug.build(views, family=family, rank=rank, layer=layer)
            doc.files_not_served = [
                debug.FileProblemModel(name=p.name, reason=p.reason, detail=p.detail)
                for p in sources.problems()
            ]
            return doc

        try:
            doc = await anyio.to_thread.run_sync(build)
        except debug.FilterError as e:
            return _problem(e.param, str(e))
        if debug_html is not None and wants_html(request.headers.get("accept")):
            return HTMLResponse(debug_html(doc))
        return doc

    @router.get("/healthz", response_model=Health, summary="The exporter process is serving")
    async def healthz() -> Health:  # documents the route; served below
        raise AssertionError("served by exporter.serving.HealthEndpoint")

    # The two hot routes as plain ASGI apps, matched before the documented ones above: a
    # scrape or a probe then costs the event loop a lookup and two sends (exporter.serving).
    router.routes[:0] = [
        Route("/metrics", MetricsEndpoint(reader, bodies), methods=["GET"]),
        Route("/healthz", HealthEndpoint(), methods=["GET"]),
    ]

    @router.get(
        "/readyz",
        response_model=Readiness,
        summary="Ready while at least one source is up",
        responses={503: {"model": Readiness}},
    )
    async def readyz() -> Readiness | JSONResponse:
        _, views = await reader.read()
        up = sum(v.up for v in views)
        ready = Readiness(
            status="ready" if up else "waiting for a live source",
            sources=len(views),
            up=up,
        )
        if up:
            return ready
        return JSONResponse(status_code=503, content=ready.model_dump())

    return router


def _problem(param: str, detail: str) -> JSONResponse:
    return JSONResponse(status_code=400, content=Problem(detail=detail, param=param).model_dump())


def create_app(
    sources: Sources,
    *,
    token: str | None = None,
    title: str = "kvledger",
    debug_html: DebugHtml | None = None,
) -> FastAPI:
    app = FastAPI(
        title=title,
        summary="KV-cache memory accounting: tensor, reserved, physical and occupied bytes "
        "per buffer family",
    )
    app.include_router(create_router(sources, token=token, debug_html=debug_html))
    app.state.sources = sources
    return app
