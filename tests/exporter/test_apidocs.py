"""/docs works without a network: the package's own page, rendered by headless Chromium, lists
the endpoints and schemas from /openapi.json and asks for nothing outside loopback."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exporter import apidocs
from exporter.app import create_app
from exporter.sources import Sources
from tests import browser
from tests.servers import UvicornThread

needs_chromium = pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")


def test_docs_is_the_packages_page_and_the_cdn_pages_are_off():
    client = TestClient(create_app(Sources()))
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '"/openapi.json"' in page.text and "openapi.json" in page.text
    for far in ("http://", "https://", "//cdn", "@import"):
        assert far not in page.text, far
    assert client.get("/redoc").status_code == 404
    assert client.get("/docs/oauth2-redirect").status_code == 404
    assert "/docs" not in client.get("/openapi.json").json()["paths"]


def test_docs_follows_the_mount_point():
    parent = FastAPI()
    parent.mount("/kvledger", create_app(Sources()))
    client = TestClient(parent)
    page = client.get("/kvledger/docs")
    assert page.status_code == 200 and '"/kvledger/openapi.json"' in page.text
    assert client.get("/kvledger/openapi.json").status_code == 200


def test_the_url_cannot_break_out_of_its_script():
    text = apidocs.page("/x</script><script>alert(1)</script>")
    assert "</script><script>alert(1)" not in text


@pytest.mark.slow
@needs_chromium
def test_chromium_renders_docs_offline():
    app = create_app(Sources())
    with UvicornThread(app) as server:
        dom, urls = browser.dump_dom_and_requests(f"{server.url}/docs", budget_ms=4000)
    parsed = browser.parse(dom)
    ops = {e["data-op"] for e in parsed.elements if "data-op" in e}
    assert {"GET /metrics", "GET /debug/kv", "GET /healthz", "GET /readyz"} <= ops
    schemas = {e["data-schema"] for e in parsed.elements if "data-schema" in e}
    assert {"DebugKv", "SourceModel", "Figures"} <= schemas
    assert not any(e.get("id") == "load-error" for e in parsed.elements)
    assert any(e.get("data-rendered") == "1" for e in parsed.elements if e["tag"] == "body")
    text = " ".join(parsed.text)
    assert "keep one buffer family" in text  # a parameter's description, from the schema
    outside = {u for u in urls if not u.startswith(server.url)}
    assert urls and not outside, outside


@pytest.mark.slow
@needs_chromium
def test_the_check_sees_a_page_that_reaches_a_cdn():
    """FastAPI's own Swagger UI (what /docs was): the same check catches its CDN requests."""
    with UvicornThread(FastAPI()) as server:
        _, urls = browser.dump_dom_and_requests(f"{server.url}/docs", budget_ms=3000)
    assert {u for u in urls if not u.startswith(server.url)}, urls
