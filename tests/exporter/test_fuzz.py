"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis): no request gets a 5xx, and every
response conforms to the documented schema."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

from exporter.app import create_app  # noqa: E402
from exporter.sources import Sources  # noqa: E402
from tests.ledgers import small_ledger  # noqa: E402

# The apps exist at import (schemathesis reads the schema then); the ledger they serve is
# built for this module's tests only and closed after them.
_sources = Sources()
APP = create_app(_sources, token=None)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def served_ledger():
    with small_ledger({"model_name": "fuzz", "tp_rank": "0"}) as sl:
        sl.allocate(300)
        name = _sources.add_ledger(sl.ledger)
        yield sl
        _sources.remove_ledger(name)


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_from_its_schema(case):
    case.call_and_validate(
        checks=[not_a_server_error, status_code_conformance, response_schema_conformance]
    )


_TOKEN_APP = create_app(_sources, token="fuzz-token")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    params=st.dictionaries(
        st.sampled_from(["family", "rank", "layer", "x", "family[]"]) | st.text(max_size=8),
        st.text(max_size=12),
        max_size=4,
    ),
    accept=st.text(max_size=40),
    auth=st.text(max_size=20),
    path=st.sampled_from(["/metrics", "/debug/kv", "/healthz", "/readyz"]),
)
def test_arbitrary_queries_and_headers_never_5xx(params, accept, auth, path):
    def raw(text: str) -> bytes:
        return text.replace("\r", " ").replace("\n", " ").encode("latin-1", "replace")

    headers = {"accept": raw(accept), "authorization": b"Bearer " + raw(auth)}
    for app in (APP, _TOKEN_APP):
        r = TestClient(app).get(path, params=params, headers=headers)
        assert r.status_code < 500, (path, params, headers, r.text)
        if path == "/debug/kv" and r.status_code in (400, 422):
            body = r.json()
            assert "detail" in body
