from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from accounting.figures import FIGURES
from accounting.snapfile.writer import Publisher
from exporter import metrics as m
from exporter.app import create_app
from exporter.sources import Sources
from tests.ledgers import small_ledger

ACCEPTS = [
    None,
    "*/*",
    "text/plain",
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=underscores",
    "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values",
    "application/openmetrics-text",
    "application/openmetrics-text;version=0.0.1",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=underscores",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=2.0.0;escaping=allow-utf-8",
    # what Prometheus 2.x sends
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    # what Prometheus 3.x sends
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "text/plain;q=1,application/openmetrics-text;q=0.1",
]


@pytest.fixture
def small():
    with small_ledger() as sl:
        sl.allocate(400)
        sl.c4.occupy(9)
        yield sl


def exposed_names(text: str) -> tuple[set[str], set[str]]:
    """(sample names, names in HELP/TYPE lines) of an exposition."""
    samples, meta = set(), set()
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            meta.add(line.split(" ")[2])
        elif line and not line.startswith("#"):
            samples.add(line.split("{")[0].split(" ")[0])
    return samples, meta


def test_metrics_names_are_the_same_whatever_the_accept_header(small):
    src = Sources()
    src.add_ledger(small.ledger)
    client = TestClient(create_app(src))
    seen = {}
    for accept in ACCEPTS:
        headers = {"accept": accept} if accept is not None else {}
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 200, accept
        assert "escaping" not in r.headers["content-type"]
        samples, meta = exposed_names(r.text)
        seen[accept] = samples
        assert m.HEADLINE in samples, accept
        assert samples <= m.series_names(), (accept, samples - m.series_names())
        assert meta <= {s.family_name for s in m.METRICS} | {s.name for s in m.METRICS}, accept
    first = next(iter(seen.values()))
    assert all(s == first for s in seen.values())


def test_openmetrics_is_chosen_by_preference(small):
    src = Sources()
    src.add_ledger(small.ledger)
    client = TestClient(create_app(src))
    r = client.get("/metrics", headers={"accept": ACCEPTS[16]})
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n")
    r = client.get("/metrics", headers={"accept": ACCEPTS[-1]})
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_debug_kv_matches_the_snapshot_and_filters(small):
    src = Sources()
    src.add_ledger(small.ledger)
    client = TestClient(create_app(src))
    body = client.get("/debug/kv").json()
    snap = small.ledger.snapshot()
    [s] = body["sources"]
    assert s["epoch"] == snap.epoch
    assert s["totals"] == {f.name: snap.total(f.name) for f in FIGURES}
    assert [f["name"] for f in body["figures"]] == [f.name for f in FIGURES]
    assert {b["name"] for b in s["buffers"]} == {b.spec.name for b in snap.buffers}
    assert s["reconciliation"][0]["source"] == "host_memfd"
    assert s["reconciliation"][0]["unattributed_bytes"] == 0
    assert body["ranks"][0]["engine_labels"]["tp_rank"] == "0"
    fam = {f["family"]: f["figures"] for f in s["families"]}
    assert fam["c4_kv"]["occupied_slots"] == 9

    only = client.get("/debug/kv", params={"family": "swa_kv", "layer": 1}).json()["sources"][0]
    assert [b["name"] for b in only["buffers"]] == ["swa_kv.L1"]
    assert [f["family"] for f in only["families"]] == ["swa_kv"]
    assert [a["family"] for a in only["accounts"]] == ["swa_kv"]
    assert client.get("/debug/kv", params={"rank": 0}).json()["sources"]


@pytest.mark.parametrize(
    "params, status, param",
    [
        ({"family": "nope"}, 400, "family"),
        ({"family": "a b"}, 422, "family"),
        ({"rank": "x"}, 422, "rank"),
        ({"rank": -1}, 422, "rank"),
        ({"rank": 5}, 400, "rank"),
        ({"layer": 99}, 400, "layer"),
        ({"layer": "1.5"}, 422, "layer"),
        ({"fam": "swa_kv"}, 400, "fam"),
    ],
)
def test_bad_parameters_are_named(small, params, status, param):
    src = Sources()
    src.add_ledger(small.ledger)
    r = TestClient(create_app(src)).get("/debug/kv", params=params)
    assert r.status_code == status
    assert param in r.text


def test_token_protects_debug_only(small):
    src = Sources()
    src.add_ledger(small.ledger)
    client = TestClient(create_app(src, token="s3cret"))
    assert client.get("/debug/kv").status_code == 401
    assert client.get("/debug/kv").headers["www-authenticate"] == "Bearer"
    bad = {"authorization": "Bearer nope"}
    assert client.get("/debug/kv", headers=bad).status_code == 401
    ok = {"authorization": "Bearer s3cret"}
    assert client.get("/debug/kv", headers=ok).status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/healthz").status_code == 200


def test_health_and_readiness(tmp_path, small):
    src = Sources(tmp_path)
    client = TestClient(create_app(src))
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 503
    with Publisher(small.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json()["up"] == 1
    assert client.get("/readyz").status_code == 503


def test_mountable_in_an_engine_app(small):
    engine = FastAPI()

    @engine.get("/generate")
    def generate() -> dict:
        return {"ok": True}

    src = Sources()
    src.add_ledger(small.ledger)
    engine.mount("/kvledger", create_app(src))
    client = TestClient(engine)
    assert client.get("/generate").json() == {"ok": True}
    r = client.get("/kvledger/metrics")
    assert r.status_code == 200 and m.HEADLINE in r.text
    assert client.get("/kvledger/healthz").json() == {"status": "ok"}
    assert client.get("/kvledger/debug/kv").json()["sources"][0]["up"] is True
    assert client.get("/metrics").status_code == 404  # only under its mount point


def test_hot_paths_skip_the_framework_and_a_scrape_costs_one_thread_hop(small, monkeypatch):
    """/metrics and /healthz are answered before FastAPI's middleware; after the first scrape
    of a format, its body is built in the scan's own worker thread."""
    import anyio.to_thread

    from exporter import serving

    src = Sources()
    src.add_ledger(small.ledger)
    app = create_app(src)
    seen: list[str] = []

    @app.middleware("http")
    async def record(request, call_next):
        seen.append(request.url.path)
        return await call_next(request)

    hops: list[str] = []
    real = anyio.to_thread.run_sync

    async def counting(fn, *args, **kw):
        hops.append(getattr(fn, "__name__", "?"))
        return await real(fn, *args, **kw)

    monkeypatch.setattr(serving.anyio.to_thread, "run_sync", counting)
    client = TestClient(app)
    for _ in range(3):
        assert client.get("/healthz").status_code == 200
        assert client.head("/healthz").status_code == 200
    assert hops == []  # answered in the event loop
    assert client.get("/metrics").status_code == 200
    assert hops == ["_read", "_build"]  # the first scrape of this format: two hops
    for _ in range(3):
        hops.clear()
        assert m.HEADLINE in client.get("/metrics").text
        assert hops == ["_read"]  # then one: the body comes with the scan
    assert client.get("/readyz").status_code == 200
    assert seen == ["/readyz"]  # the hot paths never reached the framework


def test_openapi_documents_the_debug_schema(small):
    schema = TestClient(create_app(Sources())).get("/openapi.json").json()
    comps = schema["components"]["schemas"]
    assert set(comps["Figures"]["properties"]) == {f.name for f in FIGURES}
    for f in FIGURES:
        assert f.meaning in comps["Figures"]["properties"][f.name]["description"]
    params = {p["name"] for p in schema["paths"]["/debug/kv"]["get"]["parameters"]}
    assert params == {"family", "rank", "layer"}
    assert "SourceModel" in comps and "BufferModel" in comps


def test_debug_html_hook_serves_browsers_the_same_document(small):
    src = Sources()
    src.add_ledger(small.ledger)
    seen = []

    def page(doc) -> str:
        seen.append(doc)
        return f"<html><body>{doc.sources[0].epoch}</body></html>"

    client = TestClient(create_app(src, debug_html=page))
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    r = client.get("/debug/kv", headers={"accept": browser})
    assert r.headers["content-type"].startswith("text/html")
    assert str(seen[0].sources[0].epoch) in r.text
    assert client.get("/debug/kv", headers={"accept": "application/json"}).json()["sources"]
    assert client.get("/debug/kv").json()["sources"]
    # without the hook a browser gets the JSON
    r = TestClient(create_app(src)).get("/debug/kv", headers={"accept": browser})
    assert r.headers["content-type"].startswith("application/json")


def test_gzip_when_asked_once_per_scan_and_identical_once_unzipped(small):
    import gzip

    src = Sources()
    src.add_ledger(small.ledger)
    client = TestClient(create_app(src))
    # httpx asks for gzip by default and unzips: ask explicitly and read the raw bytes.
    plain = client.get("/metrics", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert plain.headers["vary"] == "Accept-Encoding"
    with client.stream("GET", "/metrics", headers={"accept-encoding": "gzip"}) as r:
        raw = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip"
    assert len(raw) < len(plain.content) / 3
    unzipped = gzip.decompress(raw).decode()
    # the same series (the age gauge moves between two scans)
    drop_age = lambda t: [ln for ln in t.splitlines() if "age_seconds" not in ln]  # noqa: E731
    assert drop_age(unzipped) == drop_age(plain.text)
    with client.stream("GET", "/metrics", headers={"accept-encoding": "gzip;q=0, br"}) as r:
        assert "content-encoding" not in r.headers


@pytest.mark.parametrize(
    "header, expected",
    [
        (None, False),
        ("gzip", True),
        ("br, GZIP;q=0.5", True),
        ("gzip;q=0", False),
        ("gzip;q=nope", False),
        ("x-gzip", True),
        ("deflate, identity", False),
    ],
)
def test_accepts_gzip(header, expected):
    from exporter.serving import accepts_gzip

    assert accepts_gzip(header) is expected


def test_ready_only_while_a_source_is_up_and_refused_files_are_listed(tmp_path, small):
    import json

    from accounting.snapfile.format import parse

    src = Sources(tmp_path, stale_after=60, clock=lambda: 2e9)  # every heartbeat is old
    client = TestClient(create_app(src))
    with Publisher(small.ledger, tmp_path, interval=1000) as pub:
        envelope, _ = parse(Path(pub.path).read_bytes())
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json() == {
            "status": "waiting for a live source",
            "sources": 1,
            "up": 0,
        }
    (tmp_path / "bad.json").write_bytes(json.dumps({**envelope, "interval": "x"}).encode())
    body = client.get("/debug/kv").json()
    assert body["files_not_served"] == [
        {"name": "bad.json", "reason": "parse", "detail": body["files_not_served"][0]["detail"]}
    ]
    metrics = client.get("/metrics").text
    assert 'kvledger_snapshot_file_errors_total{reason="parse"} 1\n' in metrics
    assert "kvledger_sources_unreadable 1\n" in metrics


def test_healthz_answers_while_a_scan_is_stuck(small):
    """A scan that takes long (a huge or slow directory) does not hold /healthz up."""
    import threading
    import time

    release = threading.Event()

    class SlowSources(Sources):
        def read(self):
            release.wait(10)
            return super().read()

    src = SlowSources()
    src.add_ledger(small.ledger)
    app = create_app(src)
    with TestClient(app) as client:
        done: list[int] = []
        scrape = threading.Thread(target=lambda: done.append(client.get("/metrics").status_code))
        scrape.start()
        t0 = time.monotonic()
        assert client.get("/healthz").status_code == 200
        assert time.monotonic() - t0 < 1.0
        assert not done  # the scrape is still waiting for its scan
        release.set()
        scrape.join(10)
        assert done == [200]


def test_a_failed_buffer_map_is_that_sources_only_and_counted(tmp_path, small):
    """Buffer rows are checked when /debug/kv asks for them: a failure there is shown for that
    source and counted, its metrics and the other source's buffer map stay."""
    import json

    from accounting.snapfile.format import parse

    with Publisher(small.ledger, tmp_path, interval=1000, source="good") as pub:
        envelope, _ = parse(Path(pub.path).read_bytes())
        snap = envelope["snapshot"]
        snap = {**snap, "labels": {**snap["labels"], "model_name": "other"}}
        bad = json.dumps({**envelope, "source": "bad", "snapshot": snap}).encode()
        (tmp_path / "bad.json").write_bytes(bad + b"\n" + b"[" * 100_000)
        client = TestClient(create_app(Sources(tmp_path)))
        metrics = client.get("/metrics").text
        assert 'kvledger_snapshot_file_errors_total{reason="buffers"} 0\n' in metrics
        heads = [line for line in metrics.splitlines() if line.startswith(m.HEADLINE + "{")]
        assert len(heads) == 2 and heads[0].split()[-1] == heads[1].split()[-1]
        for _ in range(2):
            body = client.get("/debug/kv").json()
            by_source = {s["source"]: s for s in body["sources"]}
            assert by_source["bad"]["buffers"] == [] and by_source["bad"]["up"]
            assert by_source["bad"]["buffers_error"].startswith("nesting:")
            assert by_source["bad"]["totals"] == by_source["good"]["totals"]
            assert by_source["good"]["buffers"] and by_source["good"]["buffers_error"] is None
            assert body["files_not_served"] == []
        metrics = client.get("/metrics").text
        assert 'kvledger_snapshot_file_errors_total{reason="buffers"} 1\n' in metrics
        assert [ln for ln in metrics.splitlines() if ln.startswith(m.HEADLINE + "{")] == heads
        r = client.get("/debug/kv?layer=0").json()  # a layer filter reads the good rows
        assert {s["source"]: len(s["buffers"]) > 0 for s in r["sources"]} == {
            "bad": False,
            "good": True,
        }


def test_metrics_and_healthz_are_declared_once_documented_and_served_when_included(small):
    """One declaration each: documented in the schema (GET only), answered by the plain ASGI
    app before FastAPI in create_app, and through FastAPI's routing in an engine's app that
    includes the router, HEAD included."""
    from exporter.app import AsgiRoute, create_router
    from exporter.serving import HealthEndpoint, MetricsEndpoint

    src = Sources()
    src.add_ledger(small.ledger)
    app = create_app(src)
    paths = TestClient(app).get("/openapi.json").json()["paths"]
    assert set(paths["/metrics"]) == {"get"} and set(paths["/healthz"]) == {"get"}
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert not paths["/metrics"]["get"].get("parameters")
    assert {p: type(a) for p, a in app.hot_paths.items()} == {
        "/metrics": MetricsEndpoint,
        "/healthz": HealthEndpoint,
    }
    engine = FastAPI()
    router = create_router(src)
    engine.include_router(router, prefix="/kv")
    routed = [r for r in router.routes if isinstance(r, AsgiRoute)]
    assert sorted((r.path, sorted(r.methods or ())) for r in routed) == [
        ("/healthz", ["GET"]),
        ("/healthz", ["HEAD"]),
        ("/metrics", ["GET"]),
        ("/metrics", ["HEAD"]),
    ]
    client = TestClient(engine)
    r = client.get("/kv/metrics")
    assert r.status_code == 200 and m.HEADLINE in r.text
    assert client.head("/kv/metrics").status_code == 200
    assert client.get("/kv/healthz").json() == {"status": "ok"}
    assert client.head("/kv/healthz").status_code == 200
    assert client.post("/kv/metrics").status_code == 405
