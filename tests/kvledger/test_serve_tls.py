"""`kvledger serve --web.config.file`: TLS and basic auth as Prometheus exporters serve them,
scraped by Debian's Prometheus with the job of the generated `prometheus-tls.yml` (a
self-signed certificate made here with openssl); a wrong password is refused (401)."""

from __future__ import annotations

import contextlib
import ssl
import time
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


def _closed_counts(url: str, ctx: ssl.SSLContext) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", verify=ctx, timeout=5).text
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvledger_connections_closed_total"
    }


@pytest.mark.parametrize(
    ("fd_limit", "attackers", "drip"),
    [(320, 330, None), (None, 64, 0.5)],
    ids=["fd320-silent", "fd-default-drip"],
)
def test_tls_connections_without_a_handshake_count_from_accept(tmp_path, fd_limit, attackers, drip):
    """Issue 43 finding 2, scaled: TCP connections to the TLS port that never send a
    ClientHello (or drip one byte of one every 0.5 s), past the cap (32) and, under a
    320-descriptor limit, past every descriptor. Before, a connection was invisible to the
    guard until its handshake completed (asyncio's 60 s handshake timeout): the silent ones
    held every descriptor and the scraper got nothing. Now each counts from its accept, the
    one waiting longest is evicted past the cap, and the handshake has the request timeout:
    the scraper (a new TLS connection each time) gets every answer, p99 under 50 ms."""
    import resource

    from tests.floods import SilentTLS, probe, raw_get, rss_kib

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cert, key = tls.self_signed(tmp_path)
    web = tls.web_config(
        tmp_path / "web.yml", {"tls_server_config": {"cert_file": cert.name, "key_file": key.name}}
    )

    def lower() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    log = tmp_path / "serve.log"
    args = [
        *("--port", "0", "--no-demo", "--snapshot-dir", str(tmp_path / "snap")),
        *("--web.config.file", str(web), "--log-interval", "3600"),
        *("--max-connections", "32", "--request-timeout", "3"),
    ]
    ctx = ssl.create_default_context(cafile=str(cert))
    with open(log, "wb") as err, ServeProcess(args, stderr=err, preexec_fn=lower) as serve:
        host, port = serve.url.removeprefix("https://").rsplit(":", 1)
        addr = (host, int(port))
        get = raw_get(addr, tls=ctx)
        wait_until(lambda: get("/healthz") == 200, 20, "serving")
        probe(get, 0.5)
        rss0 = rss_kib(serve.proc.pid)
        flood = SilentTLS(addr, attackers, drip=drip)
        flood.reopen = 2.0
        with flood:
            wait_until(lambda: flood.opened >= attackers, 30, "every attacker connected")
            got = probe(get, 6)
        print(f"silent TLS ({fd_limit=}, {attackers=}, {drip=}): {got.summary()}")
        # The aim is none. Against attackers that reconnect as fast as they are
        # evicted, a new client's connection can itself be the oldest one waiting for a
        # moment: 3 of 212 were closed in a CI clone on 2 busy cores (fd limit 320, 330
        # attackers). Before the guard counted handshakes, every request failed.
        assert len(got.failures) <= max(1, len(got.results) // 50), got.summary()
        assert got.p99() < 0.05, got.summary()
        closed = _closed_counts(serve.url, ctx)
        assert closed["evicted"] + closed["request_timeout"] >= 32, closed
        wait_until(lambda: rss_kib(serve.proc.pid) <= rss0 * 1.2, 10, f"RSS near {rss0} KiB")
    text = log.read_text(errors="replace")
    assert "Too many open files" not in text and "Traceback" not in text, text[-3000:]


def test_the_heap_a_crowd_of_tls_connections_held_is_given_back_once_they_go(tmp_path):
    """Issue 43, attack 2 at its first size: 1,100 TCP connections to the TLS port that never
    send a ClientHello, under a 1,024-descriptor limit, with the server's default cap. Each
    accepted connection's TLS state and buffers come from glibc's heap, which keeps what
    they freed: before, RSS stayed where the flood left it (113 of 60 MiB after, in
    `scripts/attack-probe`). Now the guard says when a crowd of connections has gone and the
    directory scan gives the heap back: at least half of what the flood added is returned
    (what stays is Python's allocator's arenas, docs/security.md)."""
    import resource

    from tests.floods import SilentTLS, probe, raw_get, rss_kib

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip(f"the hard descriptor limit is {hard}: 1,100 attackers need more")
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cert, key = tls.self_signed(tmp_path)
    web = tls.web_config(
        tmp_path / "web.yml", {"tls_server_config": {"cert_file": cert.name, "key_file": key.name}}
    )

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    log = tmp_path / "serve.log"
    args = [
        *("--port", "0", "--no-demo", "--snapshot-dir", str(tmp_path / "snap")),
        *("--web.config.file", str(web), "--log-interval", "3600"),
    ]
    ctx = ssl.create_default_context(cafile=str(cert))
    with open(log, "wb") as err, ServeProcess(args, stderr=err, preexec_fn=lower) as serve:
        host, port = serve.url.removeprefix("https://").rsplit(":", 1)
        addr = (host, int(port))
        get = raw_get(addr, tls=ctx)
        wait_until(lambda: get("/healthz") == 200, 20, "serving")
        probe(get, 1.0)
        rss0 = rss_kib(serve.proc.pid)
        flood = SilentTLS(addr, 1100)
        flood.reopen = 2.0
        with flood:
            wait_until(lambda: flood.opened >= 1100, 60, "every attacker connected")
            got = probe(get, 3)
            peak = rss_kib(serve.proc.pid)
        added = peak - rss0
        print(f"silent TLS x1100: {got.summary()}; RSS {rss0} -> {peak} KiB")
        assert added > 16 << 10, (rss0, peak)  # the flood did hold memory (40-60 MiB here)
        assert not got.failures, got.summary()
        wait_until(
            lambda: rss_kib(serve.proc.pid) <= rss0 + added / 2,
            15,
            f"half of the {added} KiB the flood added given back (RSS {rss0} KiB at the start)",
        )
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("fd_limit", [1024, None], ids=["fd1024", "fd-default"])
def test_a_flood_of_wrong_passwords_does_not_crowd_out_the_scraper(tmp_path, fd_limit):
    """Issue 43 finding 3, scaled: 64 connections (cap 32) each sending a new wrong
    password for the scraper's user as soon as the last is answered. Before, every request
    waiting for its bcrypt check (two at a time) counted as being answered, so the cap
    filled and the scraper got 503. Now at most 8 wait beyond the 2 running and the rest
    are answered 503 at once; a remembered scraper never waits: each of its /healthz and
    /metrics (new connections, and one kept alive) answers. A credential
    not seen before (Prometheus after a restart) is answered or refused within a few
    checks' time, and gets in once the flood ends (not during it: see docs/security.md)."""
    import resource

    from tests.floods import WrongPasswords, probe, raw_get, rss_kib

    fresh_password = "never sent before"
    web = tls.web_config(
        tmp_path / "web.yml",
        {
            "basic_auth_users": {
                "prometheus": basicauth.hash_password(PASSWORD, rounds=10),
                "restarted": basicauth.hash_password(fresh_password, rounds=10),
            }
        },
    )

    def lower() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    log = tmp_path / "serve.log"
    args = [
        *("--port", "0", "--no-demo", "--snapshot-dir", str(tmp_path / "snap")),
        *("--web.config.file", str(web), "--log-interval", "3600"),
        *("--max-connections", "32", "--request-timeout", "3"),
    ]
    with open(log, "wb") as err, ServeProcess(args, stderr=err, preexec_fn=lower) as serve:
        host, port = serve.url.removeprefix("http://").rsplit(":", 1)
        addr = (host, int(port))
        get = raw_get(addr, auth=f"prometheus:{PASSWORD}")
        wait_until(lambda: get("/healthz") == 200, 20, "serving")  # remembered from here
        probe(get, 0.5)
        rss0 = rss_kib(serve.proc.pid)
        with (
            WrongPasswords(addr, 64, "prometheus") as attack,
            httpx.Client(base_url=serve.url, auth=("prometheus", PASSWORD), timeout=5) as kept,
        ):
            wait_until(lambda: sum(attack.statuses.values()) >= 64, 20, "the flood answered")
            got = probe(get, 4)
            alive = probe(kept.get, 2)
            fresh = raw_get(addr, auth=f"restarted:{fresh_password}")
            t0 = time.monotonic()
            fresh_status = fresh("/metrics")
            fresh_s = time.monotonic() - t0
        print(
            f"wrong passwords ({fd_limit=}): new connections {got.summary()}; kept alive "
            f"{alive.summary()}; fresh credential {fresh_status} in {fresh_s * 1000:.0f} ms; "
            f"flood {attack.statuses}"
        )
        assert not got.failures and not alive.failures, (got.summary(), alive.summary())
        # p99 22-38 ms measured at a load of ~2.7 on 2 cores, 55-320 ms at 4.3+: the flood's
        # thousands of refusals a second share the event loop and this machine's cores. The
        # bound here says only that nothing waits behind a password check (bcrypt: ~60 ms
        # each, 10 queued); the old code's failure is the 503s above.
        assert got.p99() < 1.0 and alive.p99() < 1.0, (got.summary(), alive.summary())
        # Not seen before, it waits for a check like the flood's: answered (or refused
        # with 503, to retry) within a few checks' time, never left waiting.
        assert fresh_status in (200, 503) and fresh_s < 1.0, (fresh_status, fresh_s)
        wait_until(lambda: fresh("/metrics") == 200, 5, "the fresh credential in after the flood")
        assert attack.statuses.get("503", 0) > 0 and attack.statuses.get("401", 0) > 0
        wait_until(lambda: rss_kib(serve.proc.pid) <= rss0 * 1.2, 10, f"RSS near {rss0} KiB")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]


def _new_credentials_during_a_flood(
    tmp_path: Path, attackers: dict[str, int], newcomer: str, ready: str
) -> tuple[dict[str, tuple[int, float]], list[dict[str, int]]]:
    """`kvledger serve` with basic auth (bcrypt cost 10, `--max-connections 128`); from each
    address of `attackers`, that many connections flood new wrong passwords; once `ready`
    holds ("queue full": each address answered 503 ten times; "failed and full": each
    failed a check and 20 answers were 503), three credentials never seen before are sent
    one after another from `newcomer`. Returns (user -> (status, seconds)) and the flood's
    answers by status, per address; no traceback in the server's log."""
    from tests.floods import WrongPasswords, raw_get

    fresh = {f"restarted{i}": f"new password {i}" for i in range(3)}
    users = {name: basicauth.hash_password(pw, rounds=10) for name, pw in fresh.items()}
    web = tls.web_config(
        tmp_path / "web.yml",
        {"basic_auth_users": {"prometheus": basicauth.hash_password(PASSWORD, rounds=10), **users}},
    )
    log = tmp_path / "serve.log"
    args = [
        *("--port", "0", "--no-demo", "--snapshot-dir", str(tmp_path / "snap")),
        *("--web.config.file", str(web), "--log-interval", "3600"),
        *("--max-connections", "128", "--request-timeout", "5"),
    ]
    conditions = {
        "queue full": lambda attacks: all(a.statuses.get("503", 0) >= 10 for a in attacks),
        "failed and full": lambda attacks: (
            all(a.statuses.get("401", 0) >= 1 for a in attacks)
            and sum(a.statuses.get("503", 0) for a in attacks) >= 20
        ),
    }
    with open(log, "wb") as err, ServeProcess(args, stderr=err) as serve:
        host, port = serve.url.removeprefix("http://").rsplit(":", 1)
        addr = (host, int(port))
        scraper = raw_get(addr, auth=f"prometheus:{PASSWORD}")
        wait_until(lambda: scraper("/healthz") == 200, 20, "serving")
        with contextlib.ExitStack() as floods:
            attacks = [
                floods.enter_context(WrongPasswords(addr, n, "prometheus", source=source))
                for source, n in attackers.items()
            ]
            wait_until(lambda: conditions[ready](attacks), 30, ready)
            got = {}
            for name, password in fresh.items():
                t0 = time.monotonic()
                status = raw_get(addr, auth=f"{name}:{password}", source=newcomer)("/metrics")
                got[name] = (status, round(time.monotonic() - t0, 3))
            during = [dict(a.statuses) for a in attacks]
        print(f"fresh credentials during the flood: {got}; flood {during}")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    return got, during


def test_a_password_flood_from_a_few_addresses_leaves_room_for_a_new_credential(tmp_path):
    """Issue 43, the rest of finding 3: three addresses (127.0.0.2-4) flood new wrong
    passwords, 24 connections each, so the check queue is always full. Before, a credential
    not seen before got 503 for as long as the flood lasted; now one address holds at most 4
    places and a request from an address holding fewer takes the place of the biggest
    holder's newest waiting request: each of three credentials not seen before, from a
    fourth address (127.0.0.5), is checked and let in during the flood."""
    got, during = _new_credentials_during_a_flood(
        tmp_path, {f"127.0.0.{i}": 24 for i in (2, 3, 4)}, "127.0.0.5", "queue full"
    )
    assert all(status == 200 for status, _ in got.values()), (got, during)
    assert all(seconds < 5 for _, seconds in got.values()), got
    assert all(d.get("401", 0) > 0 and d.get("503", 0) > 0 for d in during), during


def test_a_password_flood_from_many_addresses_that_failed_leaves_room_for_a_new_credential(
    tmp_path,
):
    """The hole the test above leaves: sixteen addresses (127.0.0.10-25), one connection
    each, so none holds more places than a newcomer may take from, flood new wrong
    passwords and keep the check queue (10 places) full. Before, a credential not seen
    before got 503 for as long as the flood lasted; now a client whose last check failed
    is a suspect and ranks below one that is not: each of three credentials not seen
    before, from an address that has not failed (127.0.0.40), is checked and let in."""
    got, during = _new_credentials_during_a_flood(
        tmp_path, {f"127.0.0.{i}": 1 for i in range(10, 26)}, "127.0.0.40", "failed and full"
    )
    assert all(status == 200 for status, _ in got.values()), (got, during)
    assert all(seconds < 5 for _, seconds in got.values()), got
    assert sum(d.get("503", 0) for d in during) > 0, during
