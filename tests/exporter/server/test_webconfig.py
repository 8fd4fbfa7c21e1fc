"""`--web.config.file`: exporter-toolkit's format read with the token file's rules; every
refusal one line naming the file and what was expected."""

from __future__ import annotations

import os
import ssl

import pytest

from exporter.server import basicauth, webconfig
from exporter.server.webconfig import WebConfigError
from tests import tls

pytestmark = pytest.mark.skipif(not tls.available(), reason="needs the openssl command")
HASH = "$2b$04$" + "a" * 53  # a well-formed bcrypt hash (not of any password checked here)


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    return tls.self_signed(tmp_path_factory.mktemp("pem"))


def test_tls_and_users_load(tmp_path, pem):
    cert, key = pem
    path = tls.web_config(
        tmp_path / "web.yml",
        {
            "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
            "basic_auth_users": {"prometheus": HASH},
        },
    )
    web = webconfig.load(str(path))
    assert isinstance(web.tls, ssl.SSLContext) and web.scheme == "https"
    assert web.tls.minimum_version == ssl.TLSVersion.TLSv1_2
    assert web.tls.verify_mode == ssl.CERT_NONE
    assert web.users == {"prometheus": HASH.encode()}


def test_relative_paths_are_relative_to_the_file_and_client_auth(tmp_path, pem):
    cert, key = pem
    for p in (cert, key):
        (tmp_path / p.name).write_bytes(p.read_bytes())
        os.chmod(tmp_path / p.name, 0o600)
    path = tls.web_config(
        tmp_path / "web.yml",
        {
            "tls_server_config": {
                "cert_file": cert.name,
                "key_file": key.name,
                "client_ca_file": cert.name,
                "client_auth_type": "RequireAndVerifyClientCert",
                "min_version": "TLS13",
            }
        },
    )
    web = webconfig.load(str(path))
    assert web.tls is not None and web.tls.verify_mode == ssl.CERT_REQUIRED
    assert web.tls.minimum_version == ssl.TLSVersion.TLSv1_3
    assert web.users == {}


def test_an_empty_file_is_plain_http(tmp_path):
    web = webconfig.load(str(tls.write_private(tmp_path / "web.yml", "")))
    assert web.tls is None and web.users == {} and web.scheme == "http"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tls_config": {}}, "unknown key 'tls_config'"),
        ({"tls_server_config": {"cert_file": "a.crt"}}, "needs both cert_file and key_file"),
        ({"tls_server_config": {"cipher_suites": ["x"]}}, "cipher_suites is not supported"),
        ({"tls_server_config": {"certfile": "x"}}, "unknown key tls_server_config.certfile"),
        ({"http_server_config": {"headers": {"a": "b"}}}, "headers is not supported"),
        ({"basic_auth_users": {"prometheus": "hunter2"}}, "expected a bcrypt hash"),
        ({"basic_auth_users": ["prometheus"]}, "must map user names to bcrypt hashes"),
        ({"basic_auth_users": {"a:b": HASH}}, "without ':'"),
        (["x"], "expected a mapping"),
    ],
)
def test_bad_documents_are_refused_in_one_line(tmp_path, doc, message):
    path = tls.web_config(tmp_path / "web.yml", doc)
    with pytest.raises(WebConfigError, match=message) as e:
        webconfig.load(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_tls_options_are_checked(tmp_path, pem):
    cert, key = pem
    base = {"cert_file": str(cert), "key_file": str(key)}
    cases = [
        ({"client_auth_type": "RequireAnyClientCert"}, "is not supported; expected one of"),
        ({"client_auth_type": "RequireAndVerifyClientCert"}, "needs client_ca_file"),
        ({"min_version": "TLS14"}, "expected one of TLS10"),
        ({"min_version": "TLS13", "max_version": "TLS12"}, "min_version is above max_version"),
        ({"cert_file": str(key)}, "do not load as a PEM certificate"),
        ({"cert_file": str(tmp_path / "missing.crt")}, "No such file"),
    ]
    for i, (extra, message) in enumerate(cases):
        path = tls.web_config(tmp_path / f"web{i}.yml", {"tls_server_config": {**base, **extra}})
        with pytest.raises(WebConfigError, match=message):
            webconfig.load(str(path))


def test_file_rules(tmp_path, pem):
    cert, key = pem
    writable = tls.web_config(tmp_path / "w.yml", {}, mode=0o622)
    with pytest.raises(WebConfigError, match="lets its group or others write it"):
        webconfig.load(str(writable))
    open_key = tmp_path / "open.key"
    open_key.write_bytes(key.read_bytes())
    os.chmod(open_key, 0o644)
    path = tls.web_config(
        tmp_path / "k.yml",
        {"tls_server_config": {"cert_file": str(cert), "key_file": str(open_key)}},
    )
    with pytest.raises(WebConfigError, match="lets others read a private key"):
        webconfig.load(str(path))
    with pytest.raises(WebConfigError, match="not a regular file"):
        webconfig.load("/dev/zero")
    with pytest.raises(WebConfigError, match="not a regular file"):
        webconfig.load(str(tmp_path))
    big = tls.write_private(tmp_path / "big.yml", "#" * (webconfig.MAX_CONFIG_BYTES + 1))
    with pytest.raises(WebConfigError, match="expected at most"):
        webconfig.load(str(big))
    bad = tls.write_private(tmp_path / "bad.yml", "a: [\n")
    with pytest.raises(WebConfigError, match="invalid YAML at line"):
        webconfig.load(str(bad))


async def _noop(scope, receive, send):  # pragma: no cover - never reached when refused
    raise AssertionError("reached")


@pytest.mark.skipif(not basicauth.available(), reason="needs bcrypt (kvledger[tls])")
def test_basic_auth_checks_users_and_remembers_a_pass():
    import anyio

    hashed = basicauth.hash_password("s3cret", rounds=4).encode()
    auth = basicauth.BasicAuth(_noop, {"prometheus": hashed})

    def header(user: str, password: str) -> bytes:
        import base64

        return b"Basic " + base64.b64encode(f"{user}:{password}".encode())

    async def main() -> None:
        assert await auth.allowed(header("prometheus", "s3cret"))
        assert len(auth._passed) == 1
        assert await auth.allowed(header("prometheus", "s3cret"))  # remembered
        assert not await auth.allowed(header("prometheus", "wrong"))
        assert not await auth.allowed(header("nobody", "s3cret"))
        assert not await auth.allowed(header("prometheus", "x" * 100))  # > 72 bytes
        assert not await auth.allowed(b"Bearer abc")
        assert not await auth.allowed(b"Basic !!!")
        assert not await auth.allowed(None)
        assert len(auth._passed) == 1
        # the password itself is never kept
        assert all(b"s3cret" not in k for k in auth._passed)

    anyio.run(main)


@pytest.mark.skipif(not basicauth.available(), reason="needs bcrypt (kvledger[tls])")
def test_basic_auth_guards_http_and_websocket_scopes():
    import anyio

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    auth = basicauth.BasicAuth(app, {"u": basicauth.hash_password("p", rounds=4).encode()})

    async def call(kind: str, headers: list) -> list:
        sent: list = []

        async def send(message):
            sent.append(message)

        await auth({"type": kind, "headers": headers}, None, send)
        return sent

    async def main() -> None:
        sent = await call("http", [])
        assert sent[0]["status"] == 401 and not reached
        assert (await call("websocket", []))[0] == {"type": "websocket.close", "code": 1008}
        assert not reached
        assert await call("lifespan", []) == [] and reached == ["lifespan"]
        good = [(b"authorization", b"Basic dTpw")]  # u:p
        assert await call("http", good) == [] and reached[-1] == "http"

    anyio.run(main)
