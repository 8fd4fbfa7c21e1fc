"""`GET /docs`: the API's reference page, served from the package, nothing from a CDN.

FastAPI's own `/docs` (Swagger UI) and `/redoc` load their scripts and styles from a
CDN, so on a host without a network they are blank. kvledger turns both off and
serves `exporter/static/docs.html` instead: one self-contained page (inline CSS and
JavaScript) that reads the app's `/openapi.json` and lists every endpoint with its
parameters and responses, and every schema with its fields. The page names
`/openapi.json`, the machine-readable schema, for any OpenAPI tool.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

TEMPLATE = "static/docs.html"
URL_MARK = "__KVLEDGER_OPENAPI_URL__"


@cache
def template() -> str:
    text = resources.files("exporter").joinpath(TEMPLATE).read_text(encoding="utf-8")
    if text.count(URL_MARK) != 1:
        raise RuntimeError(f"{TEMPLATE}: expected the mark {URL_MARK} exactly once")
    return text


def page(openapi_url: str) -> str:
    """The page, reading the schema from `openapi_url` (a path on the same server)."""
    return template().replace(URL_MARK, json.dumps(openapi_url).replace("<", "\\u003c"))


def add_docs(app: FastAPI, path: str = "/docs") -> None:
    """Serve the page at `path` (left out of the schema). The app must have been made with
    `docs_url=None, redoc_url=None` (FastAPI's CDN pages off) and an `openapi_url`."""
    if app.openapi_url is None:
        raise ValueError("add_docs: the app serves no OpenAPI schema (openapi_url=None)")
    openapi_url = app.openapi_url

    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return HTMLResponse(page(root + openapi_url))

    app.add_api_route(path, docs, methods=["GET"], include_in_schema=False)
