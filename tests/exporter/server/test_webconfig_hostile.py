"""`--web.config.file` against a hostile or careless file (issue 43, finding 6): a link to a
secret file, names that would carry secrets or break the line, YAML nested past Python's
recursion limit, duplicate keys, a cheap bcrypt cost, TLS below 1.2, a certificate out of
its dates or a key of another certificate. Each is refused in one line that quotes no more
of the file than a short escaped name, or accepted with a warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.server import webconfig
from exporter.server.webconfig import WebConfigError
from tests import tls
from tests.servers import repo_env

pytestmark = pytest.mark.skipif(not tls.available(), reason="needs the openssl command")
# webconfig.MAX_SHOWN, MAX_DEPTH, ALLOW_OLD_TLS, spelled out: these tests ran on the code
# before them too, and failed there on their assertions.
SHOWN, DEPTH, OPT_IN = 40, 32, "KVLEDGER_ALLOW_OLD_TLS"
HASH12 = "$2b$12$" + "b" * 53  # well-formed bcrypt hashes, of no password checked here
HASH04 = "$2b$04$" + "a" * 53
# A line of /etc/shadow as it is on a host whose root has a password (yescrypt).
SALT, DIGEST = "j9T$Pq1vX0mZ8kLw3sYtR2uN7b", "Zk4rW8yQ1eT6uI0oP3aS5dF7gH9jK2lZ4xC6vB8nM1q"
SHADOW = f"root:$y${SALT}${DIGEST}:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n"


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    return tls.self_signed(tmp_path_factory.mktemp("pem"))


def _refusal(path: Path) -> str:
    """The one line `load` refuses `path` with (any other exception fails the test), less
    its `--web.config.file PATH` prefix."""
    with pytest.raises(WebConfigError) as e:
        webconfig.load(str(path))
    text = str(e.value)
    assert "\n" not in text and "\r" not in text, text
    prefix = f"--web.config.file {path}"
    assert text.startswith(prefix), text
    return text.removeprefix(prefix)


def _tls_doc(cert: Path, key: Path, **extra: str) -> dict:
    return {"tls_server_config": {"cert_file": str(cert), "key_file": str(key), **extra}}


# -- links ------------------------------------------------------------------------------------


def test_a_link_is_resolved_and_its_target_checked(tmp_path, pem):
    """The decision: links are followed (a Kubernetes secret volume is links), the rules
    hold for the target. Passes before and after the change."""
    cert, key = pem
    dated_dir = tmp_path / "..2024_01_01_00_00_00.1"
    dated_dir.mkdir()
    tls.web_config(dated_dir / "web.yml", {"basic_auth_users": {"prometheus": HASH12}})
    (tmp_path / "..data").symlink_to(dated_dir.name)
    (tmp_path / "web.yml").symlink_to("..data/web.yml")
    assert webconfig.load(str(tmp_path / "web.yml")).users == {"prometheus": HASH12.encode()}
    writable = tls.web_config(tmp_path / "writable.yml", {}, mode=0o666)
    (tmp_path / "to-writable.yml").symlink_to(writable)
    assert "lets its group or others write it" in _refusal(tmp_path / "to-writable.yml")
    open_key = tmp_path / "open.key"
    open_key.write_bytes(key.read_bytes())
    os.chmod(open_key, 0o644)
    (tmp_path / "key-link").symlink_to(open_key)
    path = tls.web_config(tmp_path / "k.yml", _tls_doc(cert, tmp_path / "key-link"))
    assert "lets others read a private key" in _refusal(path)


def test_a_link_to_a_secret_file_never_echoes_it(tmp_path):
    """A config that is a link to a shadow file (root's, mode 0640: it passes the file rules)
    is refused as no web config, quoting none of it. Before: `unknown key 'root:$y$j9T$...'`."""
    shadow = tls.write_private(tmp_path / "shadow", SHADOW, mode=0o640)
    (tmp_path / "web.yml").symlink_to(shadow)
    text = _refusal(tmp_path / "web.yml")
    assert "unknown key" in text
    for secret in ("root", "$y$", SALT[:8], DIGEST[:8], "20228", "daemon"):
        assert secret not in text, text
    # The same lines under basic_auth_users, as user names: not shown either.
    users = "basic_auth_users:\n" + "".join(f"  {line}\n" for line in SHADOW.splitlines())
    text = _refusal(tls.write_private(tmp_path / "users.yml", users))
    for secret in ("root", "$y$", SALT[:8], DIGEST[:8], "20228"):
        assert secret not in text, text


@pytest.mark.skipif(not os.access("/etc/shadow", os.R_OK), reason="/etc/shadow not readable")
def test_a_link_to_etc_shadow_never_echoes_it(tmp_path):
    (tmp_path / "web.yml").symlink_to("/etc/shadow")
    with open("/etc/shadow") as f:
        fields = {x for line in f for x in line.strip().split(":") if len(x) >= 4}
    try:
        webconfig.load(str(tmp_path / "web.yml"))
    except WebConfigError as e:
        text = str(e).removeprefix(f"--web.config.file {tmp_path / 'web.yml'}")
        assert "\n" not in text
        assert not [x for x in fields if x in text], text
    else:  # pragma: no cover - an empty /etc/shadow
        pytest.skip("/etc/shadow is empty")


# -- what a refusal shows of the file ------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "not_shown"),
    [
        ({"k" * 500: 1}, "k" * 41),
        ({"tls_server_config": {"cert_file": "a", "t" * 500: "x"}}, "t" * 41),
        ({"tls_server_config": {"cert_file": "a", "key\nfile": "x"}}, "key\nfile"),
        ({"http_server_config": {"h\r\ntp2": True}}, "h\r\ntp2"),
        ({"basic_auth_users": {"u" * 500: "hunter2"}}, "u" * 41),
        ({"basic_auth_users": {"pro\nmetheus": "hunter2"}}, "pro\nmetheus"),
        ({"basic_auth_users": {"a:b" + "c" * 100: HASH12}}, "a:b"),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "T" * 99}},
            "T" * 41,
        ),
    ],
    ids=[
        "key",
        "tls-key",
        "tls-key-newline",
        "http-key-crlf",
        "user",
        "user-newline",
        "user-colon",
        "version",
    ],
)
def test_names_in_refusals_are_short_and_escaped(tmp_path, doc, not_shown):
    text = _refusal(tls.web_config(tmp_path / "web.yml", doc))
    assert not_shown not in text
    assert len(text) < 240, text
    if not_shown.count(not_shown[0]) == len(not_shown):  # a long name: cut, with an ellipsis
        assert not_shown[0] * SHOWN + "…" in text, text


def test_a_path_in_the_file_must_be_printable(tmp_path):
    path = tls.web_config(
        tmp_path / "web.yml", {"tls_server_config": {"cert_file": "a\nb", "key_file": "k"}}
    )
    assert "is not a path" in _refusal(path)


# -- nesting ----------------------------------------------------------------------------------


def _alias_merge_chain(n: int) -> str:
    """Mappings each merging the one before (`<<`), which PyYAML flattens recursively."""
    chain = ", ".join(["&x0 {k: 1}"] + [f"&x{i} {{<<: *x{i - 1}}}" for i in range(1, n)])
    return f"a: [{chain}]\n<<: *x{n - 1}\n"


@pytest.mark.parametrize(
    "text",
    [
        "[" * 1000,
        "basic_auth_users: " + "{a: " * 2000,
        "tls_server_config:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 300)),
        "- " * 2000 + "x",
        _alias_merge_chain(3000),
    ],
    ids=["brackets", "flow-maps", "block-maps", "block-seqs", "merge-chain"],
)
def test_deep_nesting_is_refused_in_one_line(tmp_path, text):
    path = tls.write_private(tmp_path / "web.yml", text)
    assert os.path.getsize(path) <= webconfig.MAX_CONFIG_BYTES
    text = _refusal(path)  # before: RecursionError
    assert f"nested deeper than {DEPTH} levels" in text or "merge key '<<' is not supported" in text


def test_nesting_within_the_bound_is_read(tmp_path):
    depth = DEPTH - 1  # the file's mapping holds the outermost list
    path = tls.write_private(tmp_path / "web.yml", "x: " + "[" * depth + "]" * depth)
    assert "unknown key 'x'" in _refusal(path)


@pytest.mark.parametrize(
    "text",
    ["a: 2020-13-45\n", "a: " + "1" * 5000 + "\n", "? [a, b]\n: c\n"],
    ids=["date-month-13", "int-5000-digits", "sequence-key"],
)
def test_values_pyyaml_cannot_build_are_refused_in_one_line(tmp_path, text):
    refusal = _refusal(tls.write_private(tmp_path / "web.yml", text))  # before: ValueError
    assert "at line 1 column" in refusal and "2020" not in refusal and "1111" not in refusal


# -- duplicate keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"basic_auth_users:\n  prometheus: {HASH12}\n  prometheus: {HASH04}\n", "'prometheus'"),
        (
            "http_server_config: {http2: true}\nhttp_server_config: {http2: false}\n",
            "'http_server_config'",
        ),
        ("tls_server_config:\n  cert_file: a\n  cert_file: b\n  key_file: k\n", "'cert_file'"),
        ("http_server_config: {http2: true, http2: false}\n", "'http2'"),
    ],
    ids=["user", "top", "tls", "flow"],
)
def test_duplicate_keys_are_refused_at_every_level(tmp_path, text, message):
    refusal = _refusal(tls.write_private(tmp_path / "web.yml", text))  # before: the last won
    assert f"duplicate key {message} at line" in refusal, refusal
    assert "$2b$" not in refusal


def test_a_key_equal_to_another_in_python_is_not_a_duplicate(tmp_path):
    path = tls.write_private(tmp_path / "web.yml", "x: {1: a, true: b}\n")
    assert "unknown key 'x'" in _refusal(path)


# -- bcrypt cost ----------------------------------------------------------------------------------


def test_a_cheap_bcrypt_cost_is_accepted_with_a_warning(tmp_path, caplog):
    users = {"prometheus": HASH04, "u\n" + "v" * 100: "$2b$09$" + "c" * 53, "strong": HASH12}
    path = tls.web_config(tmp_path / "web.yml", {"basic_auth_users": users})
    with caplog.at_level(logging.WARNING, logger=webconfig.__name__):
        web = webconfig.load(str(path))
    assert web.users == {u: h.encode() for u, h in users.items()}
    [record] = [r for r in caplog.records if r.name == webconfig.__name__]
    line = record.getMessage()
    assert record.levelno == logging.WARNING and "\n" not in line
    assert "'prometheus' (cost 4)" in line and "(cost 9)" in line, line
    assert "strong" not in line and "$2b$" not in line and "v" * 41 not in line
    caplog.clear()
    tls.web_config(tmp_path / "ok.yml", {"basic_auth_users": {"strong": HASH12}})
    with caplog.at_level(logging.WARNING, logger=webconfig.__name__):
        webconfig.load(str(tmp_path / "ok.yml"))
    assert not [r for r in caplog.records if r.name == webconfig.__name__]


# -- TLS version ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["TLS10", "TLS11"])
def test_tls_below_1_2_needs_the_opt_in(tmp_path, pem, version, monkeypatch, caplog):
    cert, key = pem
    path = tls.web_config(tmp_path / "web.yml", _tls_doc(cert, key, min_version=version))
    monkeypatch.delenv(OPT_IN, raising=False)
    refusal = _refusal(path)  # before: accepted
    assert f"min_version {version} allows TLS below 1.2" in refusal
    assert "KVLEDGER_ALLOW_OLD_TLS=1" in refusal
    monkeypatch.setenv(OPT_IN, "yes")  # only "1" allows it
    _refusal(path)
    monkeypatch.setenv(OPT_IN, "1")
    with caplog.at_level(logging.WARNING, logger=webconfig.__name__):
        web = webconfig.load(str(path))
    assert web.tls is not None and web.tls.minimum_version == webconfig._TLS_VERSIONS[version]
    assert any(version in r.getMessage() for r in caplog.records if r.name == webconfig.__name__)


# -- the certificate ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        ("20200101000000Z", "20200102000000Z", "the certificate expired 2020-01-02 00:00:00 UTC"),
        (
            "20500101000000Z",
            "20600101000000Z",
            "the certificate is not valid before 2050-01-01 00:00:00 UTC",
        ),
    ],
    ids=["expired", "not-yet-valid"],
)
def test_a_certificate_out_of_its_dates_is_refused(tmp_path, start, end, message):
    cert, key = tls.dated(tmp_path, start, end)
    refusal = _refusal(
        tls.web_config(tmp_path / "web.yml", _tls_doc(cert, key))
    )  # before: accepted
    assert f"cert_file {cert}: {message}" in refusal, refusal


def test_a_key_of_another_certificate_is_refused(tmp_path, pem):
    cert, _ = pem
    _, other_key = tls.self_signed(tmp_path, "other")
    refusal = _refusal(tls.web_config(tmp_path / "web.yml", _tls_doc(cert, other_key)))
    assert f"key_file {other_key} is not the private key of cert_file {cert}" in refusal


# -- through `kvledger serve` ---------------------------------------------------------------------


def test_serve_refuses_them_in_one_line_exit_2(tmp_path):
    """The real command (a child process): exit 2 and one line, no traceback (before: a deep
    file gave a RecursionError traceback and exit 1; the link quoted the shadow line)."""
    deep = tls.write_private(tmp_path / "deep.yml", "[" * 1000)
    shadow = tls.write_private(tmp_path / "shadow", SHADOW, mode=0o640)
    (tmp_path / "link.yml").symlink_to(shadow)
    for path, needle in (
        (deep, "nested deeper than 32 levels"),
        (tmp_path / "link.yml", "unknown key"),
    ):
        r = subprocess.run(
            [
                *(sys.executable, "-m", "kvledger", "serve", "--port", "0"),
                *("--snapshot-dir", str(tmp_path / "snapshots"), "--web.config.file", str(path)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=repo_env(),
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
        said = lines[0].removeprefix(f"kvledger serve: --web.config.file {path}")
        assert needle in said and "root" not in said and DIGEST[:8] not in said, said
