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
and format, and gzipped (once) for a client that sends `Accept-Encoding: gzip`.

`/metrics` and `/healthz` are plain ASGI apps (`exporter.serving`), each declared
once, as an `AsgiRoute`: FastAPI documents it in the OpenAPI schema like any route,
and a request that reaches it through routing (the router included in an engine's
app) is handed to the ASGI app. `create_app`'s `ExporterApp` calls the same apps
before FastAPI's middleware and routing (`hot_paths`, read from those routes).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from exporter import debug, debug_schema
from exporter.apidocs import add_docs
from exporter.collector import KvLedgerCollector
from exporter.serving import HealthEndpoint, MetricsBodies, MetricsEndpoint, SourceReader
from exporter.sources import Sources
from exporter.version import VERSION

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


DebugHtml = Callable[[debug_schema.DebugKv], str]


class _Delegate(Response):
    """The response of an `AsgiRoute`: the route's ASGI app answers the request itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class AsgiRoute(APIRoute):
    """A route whose endpoint is a plain ASGI app (`exporter.serving`), declared once:
    FastAPI documents it (summary, responses, response model) from the route's
    arguments, and a request routed to it is handed to the app, past FastAPI's request
    and response handling. The app declares no parameters for the schema
    (`__signature__`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        response = _Delegate(self.endpoint)

        async def handler(request: Request) -> Response:
            return response

        return handler


def add_asgi_route(
    router: APIRouter, path: str, app: Callable[..., Any], name: str, **doc: Any
) -> None:
    """`app` at GET `path`, documented by `doc` (summary, description, responses, ...), and
    at HEAD `path` (as Starlette's own routes answer it) left out of the schema."""
    router.add_api_route(
        path, app, route_class_override=AsgiRoute, name=name, methods=["GET"], **doc
    )
    router.add_api_route(
        path,
        app,
        route_class_override=AsgiRoute,
        name=f"{name}_head",
        methods=["HEAD"],
        include_in_schema=False,
    )


def hot_paths(router: APIRouter) -> dict[str, Callable[..., Any]]:
    """Path -> ASGI app of the router's `AsgiRoute`s (what `ExporterApp` answers first)."""
    return {r.path: r.endpoint for r in router.routes if isinstance(r, AsgiRoute)}


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
    bodies = MetricsBodies(collector)
    reader = SourceReader(sources, hook=bodies)
    if sources.after_scan is None:  # the first app over these sources renders ahead
        sources.after_scan = bodies.ahead
    router = APIRouter()
    auth = _auth_dependency(token)

    add_asgi_route(
        router,
        "/metrics",
        MetricsEndpoint(reader, bodies),
        "metrics",
        response_class=Response,
        summary="Prometheus exposition built from one snapshot per source",
        description="The text format 0.0.4, or OpenMetrics 1.0.0 when the client prefers it "
        "(Accept); gzipped for a client that asks (Accept-Encoding). Metric names never follow "
        "the Accept header's escaping.",
        responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}},
    )

    @router.get(
        "/debug/kv",
        response_model=debug_schema.models()[1],  # with the registered engine exports' sections
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
    ) -> debug_schema.DebugKv | JSONResponse | HTMLResponse:
        unknown = sorted(set(request.query_params) - set(DEBUG_PARAMS))
        if unknown:
            return _problem(
                unknown[0],
                f"unknown query parameter {unknown[0]!r}; expected one of {', '.join(DEBUG_PARAMS)}",
            )
        _, scan = await reader.read()

        def build() -> debug_schema.DebugKv:
            return debug.build(scan, family=family, rank=rank, layer=layer)

        try:
            doc = await anyio.to_thread.run_sync(build)
        except debug.FilterError as e:
            return _problem(e.param, str(e))
        if debug_html is not None and wants_html(request.headers.get("accept")):
            return HTMLResponse(debug_html(doc))
        return doc

    add_asgi_route(
        router,
        "/healthz",
        HealthEndpoint(),
        "healthz",
        response_model=Health,
        summary="The exporter process is serving",
        description="Answered at once, whatever the snapshot directory holds.",
    )

    @router.get(
        "/readyz",
        response_model=Readiness,
        summary="Ready while at least one source is up",
        responses={503: {"model": Readiness}},
    )
    async def readyz() -> Readiness | JSONResponse:
        _, scan = await reader.read()
        up = sum(v.up for v in scan.views)
        ready = Readiness(
            status="ready" if up else "waiting for a live source",
            sources=len(scan.views),
            up=up,
        )
        if up:
            return ready
        return JSONResponse(status_code=503, content=ready.model_dump())

    return router


def _problem(param: str, detail: str) -> JSONResponse:
    return JSONResponse(status_code=400, content=Problem(detail=detail, param=param).model_dump())


class ExporterApp(FastAPI):
    """FastAPI with `/metrics` and `/healthz` answered before the framework's middleware
    stack and routing: with many scrapers at once, every request costs the event loop, and
    a probe waits behind them (`kvledger bench scrape`, concurrent part). Everything else,
    the OpenAPI document included, is FastAPI's."""

    hot_paths: dict[str, Callable[..., Any]] = {}  # replaced by create_app, never changed in place

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            app = self.hot_paths.get(_route_path(scope))
            if app is not None:
                await app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point (a mounted app sees the full path)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


def create_app(
    sources: Sources,
    *,
    token: str | None = None,
    title: str = "kvledger",
    debug_html: DebugHtml | None = None,
) -> ExporterApp:
    app = ExporterApp(
        title=title,
        version=VERSION,
        summary="KV-cache memory accounting: tensor, reserved, physical and occupied bytes "
        "per buffer family",
        # FastAPI's Swagger UI and ReDoc come from a CDN: blank offline. exporter.apidocs
        # serves a page of the package's own at /docs instead.
        docs_url=None,
        redoc_url=None,
    )
    add_docs(app)
    router = create_router(sources, token=token, debug_html=debug_html)
    app.include_router(router)
    app.hot_paths = hot_paths(router)
    app.state.sources = sources
    return app
