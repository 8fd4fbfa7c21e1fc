"""`kvledger serve --web.config.file`: TLS and basic auth as Prometheus exporters serve them,
scraped by Debian's Prometheus with the job of the generated `prometheus-tls.yml` (a
self-signed certificate made here with openssl); a wrong password is refused (401)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
import yaml

from exporter import metrics as m
from exporter.server import basicauth
from tests import tls
from tests.kvledger.tools.dashboards import names
from tests.kvledger.tools.dashboards.live import SERVE_ARGS
from tests.servers import PROMETHEUS, Prometheus, ServeProcess, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not tls.available(), reason="needs the openssl command"),
    pytest.mark.skipif(not basicauth.available(), reason="needs bcrypt (kvledger[tls])"),
]
PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = tls.self_signed(d)
    web = tls.web_config(
        d / "web.yml",
        {
            "tls_server_config": {"cert_file": cert.name, "key_file": key.name},
            "basic_auth_users": {"prometheus": basicauth.hash_password(PASSWORD, rounds=10)},
        },
    )
    log = open(d / "serve.log", "w")  # noqa: SIM115 - closed below
    try:
        with ServeProcess(
            [
                *("--port", "0", "--snapshot-dir", str(d / "snapshots")),
                *("--web.config.file", str(web)),
                *SERVE_ARGS,
            ],
            stderr=log,
        ) as serve:
            yield serve, cert, d
    finally:
        log.close()


def _client(cert: Path, auth: tuple[str, str] | None) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), auth=auth, timeout=5)


def test_https_with_the_password_and_401_without(served):
    serve, cert, _ = served
    assert serve.url.startswith("https://127.0.0.1:")
    with _client(cert, ("prometheus", PASSWORD)) as ok:
        wait_until(lambda: ok.get(f"{serve.url}/readyz").status_code == 200, 30, "ready")
        r = ok.get(f"{serve.url}/metrics")
        assert r.status_code == 200 and m.HEADLINE in r.text
        assert ok.get(f"{serve.url}/debug/kv").json()["sources"]  # no bearer token asked
    for auth in (None, ("prometheus", "wrong"), ("nobody", PASSWORD)):
        with _client(cert, auth) as c:
            for path in ("/metrics", "/debug/kv", "/healthz", "/docs"):
                r = c.get(f"{serve.url}{path}")
                assert r.status_code == 401, (auth, path)
                assert r.headers["www-authenticate"].startswith('Basic realm="kvledger"')
                assert m.HEADLINE not in r.text
    plain = serve.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        r = httpx.get(f"{plain}/metrics", auth=("prometheus", PASSWORD), timeout=5)
        r.raise_for_status()


def _tls_job() -> dict:
    """The kvledger job of the generated prometheus-tls.yml."""
    doc = yaml.safe_load((names.PROM / "prometheus-tls.yml").read_text())
    [job] = doc["scrape_configs"]
    assert job["scheme"] == "https" and "password_file" in job["basic_auth"]
    return dict(job)


@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="needs Debian's prometheus")
def test_prometheus_scrapes_over_tls_with_basic_auth(served):
    serve, cert, d = served
    target = serve.url.removeprefix("https://")
    good = tls.write_private(d / "password", PASSWORD + "\n")
    bad = tls.write_private(d / "wrong-password", "not it\n")
    jobs = []
    for name, password in (("kvledger", good), ("kvledger-wrong", bad)):
        job = _tls_job()
        job.pop("file_sd_configs")
        job.update(job_name=name, scrape_interval="1s", static_configs=[{"targets": [target]}])
        job["tls_config"] = {**job["tls_config"], "ca_file": str(cert)}
        job["basic_auth"] = {**job["basic_auth"], "password_file": str(password)}
        jobs.append(job)
    with Prometheus([], scrape_configs=jobs) as prom:
        up = wait_until(
            lambda: (
                {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
                if len(prom.query("up")) == 2
                else None
            ),
            30,
            "both jobs scraped",
        )
        wait_until(lambda: prom.query(m.HEADLINE), 30, f"{m.HEADLINE} stored")
        assert up == {"kvledger": "1", "kvledger-wrong": "0"}, up
        targets = httpx.get(f"{prom.url}/api/v1/targets", timeout=5).json()["data"]
        errors = {t["labels"]["job"]: t["lastError"] for t in targets["activeTargets"]}
        assert errors["kvledger"] == ""
        assert "401" in errors["kvledger-wrong"], errors
