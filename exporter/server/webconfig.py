"""`kvledger serve --web.config.file FILE`: TLS and basic auth in the Prometheus exporters' format.

The file is the web configuration of Prometheus's exporter-toolkit, which node_exporter
and dcgm-exporter read (YAML):

    tls_server_config:
      cert_file: server.crt        # relative paths are relative to this file's folder
      key_file: server.key
      client_ca_file: ca.crt       # optional, with client_auth_type
      client_auth_type: RequireAndVerifyClientCert   # or VerifyClientCertIfGiven, NoClientCert
      min_version: TLS12           # TLS10..TLS13; default TLS12
      max_version: TLS13
    basic_auth_users:
      prometheus: $2b$12$...       # bcrypt hashes (htpasswd -nBC 12 "" | tr -d ':\\n')

Either section may be left out. A key kvledger does not implement (cipher_suites,
curve_preferences, http_server_config.headers, client auth types Python's ssl cannot
do) is refused by name rather than ignored, as exporter-toolkit refuses unknown keys.

Read by `exporter.server.private_file`, as the token file is (`exporter.server.token`): every file
(the config, certificates, key) must be a regular file of this user or root that neither
its group nor others can write, read with a bound; the private key must not be readable by
others either (mode 0600 or 0640). Links are followed, as a mounted secret is often one. The TLS
context is loaded from the descriptor that was checked (`/proc/self/fd/N`), so the
file checked is the file loaded. Every refusal is a `WebConfigError`, one line naming
the file and the rule. Nothing secret is ever taken from the command line.
"""

from __future__ import annotations

import os
import re
import ssl
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import yaml

from exporter.server import private_file
from exporter.server.errors import UsageError
from exporter.server.private_file import ModeRule

FLAG = "--web.config.file"
MAX_CONFIG_BYTES = 64 << 10
MAX_PEM_BYTES = 1 << 20
MAX_USERS = 1024
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# exporter-toolkit's keys that kvledger does not implement: refused by name, never ignored.
_UNSUPPORTED = {
    "tls_server_config": {
        "cipher_suites": "Python's ssl picks TLS 1.3 suites itself",
        "curve_preferences": "not settable through Python's ssl",
        "prefer_server_cipher_suites": "not settable through Python's ssl",
        "client_allowed_sans": "not implemented by kvledger",
        "cert": "give cert_file",
        "key": "give key_file",
        "client_ca": "give client_ca_file",
    },
    "http_server_config": {"headers": "not implemented by kvledger"},
}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_ca_file",
    "client_auth_type",
    "min_version",
    "max_version",
}


# Every file: nobody but its owner writes it. The private key: nor do others read it.
WRITE_RULE = ModeRule(0o022, "lets its group or others write it", "none to", "go-w")
KEY_RULE = ModeRule(0o004, "lets others read a private key", "0600 or 0640", "600")


class WebConfigError(ValueError):
    pass


def _checked(
    path: str, where: str, limit: int, *, secret: bool
) -> AbstractContextManager[tuple[bytes, int]]:
    """`exporter.server.private_file.opened` under the web config's rules (and the key's if
    `secret`): (the file's bytes, its open descriptor), closed on exit."""
    modes = (WRITE_RULE, KEY_RULE) if secret else (WRITE_RULE,)
    return private_file.opened(path, where, limit=limit, modes=modes, error=WebConfigError)


@dataclass(frozen=True)
class WebConfig:
    """What the file says: a TLS context (None: plain HTTP) and basic-auth users (name ->
    bcrypt hash; empty: no basic auth)."""

    path: str
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def load(path: str) -> WebConfig:
    """The web configuration at `path`; WebConfigError (one line) on any fault."""
    where = f"{FLAG} {path}"
    with _checked(path, where, MAX_CONFIG_BYTES, secret=False) as (data, _):
        pass
    try:
        doc = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise WebConfigError(f"{where}: not UTF-8 text, expected YAML") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise WebConfigError(f"{where}: invalid YAML{at}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise WebConfigError(f"{where}: expected a mapping of tls_server_config, basic_auth_users")
    known = {"tls_server_config", "basic_auth_users", "http_server_config"}
    for key in doc:
        if key not in known:
            raise WebConfigError(
                f"{where}: unknown key {key!r}; expected tls_server_config, basic_auth_users "
                "or http_server_config"
            )
    base = os.path.dirname(os.path.abspath(path))
    tls = _tls(doc.get("tls_server_config"), base, where)
    users = _users(doc.get("basic_auth_users"), where)
    _http(doc.get("http_server_config"), where)
    return WebConfig(path=path, tls=tls, users=users)


def _section(value: Any, name: str, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise WebConfigError(f"{where}: {name} must be a mapping")
    for key in value:
        why = _UNSUPPORTED.get(name, {}).get(key)
        if why is not None:
            raise WebConfigError(f"{where}: {name}.{key} is not supported ({why})")
    return value


def _str(section: dict[str, Any], key: str, name: str, where: str) -> str | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WebConfigError(f"{where}: {name}.{key} must be a non-empty string")
    return value


def _tls(value: Any, base: str, where: str) -> ssl.SSLContext | None:
    sec = _section(value, "tls_server_config", where)
    if not sec:
        return None
    for unknown in sec:
        if unknown not in _TLS_KEYS:
            raise WebConfigError(
                f"{where}: unknown key tls_server_config.{unknown}; expected one of "
                + ", ".join(sorted(_TLS_KEYS))
            )
    name = "tls_server_config"
    cert = _str(sec, "cert_file", name, where)
    key = _str(sec, "key_file", name, where)
    if cert is None or key is None:
        raise WebConfigError(f"{where}: {name} needs both cert_file and key_file")
    auth_name = _str(sec, "client_auth_type", name, where) or "NoClientCert"
    if auth_name not in _CLIENT_AUTH:
        raise WebConfigError(
            f"{where}: {name}.client_auth_type {auth_name!r} is not supported; expected one of "
            + ", ".join(_CLIENT_AUTH)
        )
    ca = _str(sec, "client_ca_file", name, where)
    if _CLIENT_AUTH[auth_name] != ssl.CERT_NONE and ca is None:
        raise WebConfigError(f"{where}: {name}.client_auth_type {auth_name} needs client_ca_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _version(sec, "min_version", "TLS12", where)
    ctx.maximum_version = _version(sec, "max_version", "TLS13", where)
    if ctx.minimum_version > ctx.maximum_version:
        raise WebConfigError(f"{where}: {name}.min_version is above max_version")
    cert_path, key_path = _resolve(base, cert), _resolve(base, key)
    with (
        _checked(cert_path, f"{where}: cert_file {cert_path}", MAX_PEM_BYTES, secret=False) as (
            _,
            cert_fd,
        ),
        _checked(key_path, f"{where}: key_file {key_path}", MAX_PEM_BYTES, secret=True) as (
            _,
            key_fd,
        ),
    ):
        try:
            ctx.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}")
        except (ssl.SSLError, OSError) as e:
            raise WebConfigError(
                f"{where}: cert_file {cert_path} and key_file {key_path} do not load as a PEM "
                f"certificate and its private key ({_reason(e)})"
            ) from None
    if ca is not None:
        ca_path = _resolve(base, ca)
        with _checked(
            ca_path, f"{where}: client_ca_file {ca_path}", MAX_PEM_BYTES, secret=False
        ) as (data, _):
            try:
                ctx.load_verify_locations(cadata=data.decode("ascii"))
            except (ssl.SSLError, UnicodeDecodeError, ValueError) as e:
                raise WebConfigError(
                    f"{where}: client_ca_file {ca_path} is not PEM certificates ({_reason(e)})"
                ) from None
    ctx.verify_mode = _CLIENT_AUTH[auth_name]
    return ctx


def _reason(e: BaseException) -> str:
    return " ".join(str(getattr(e, "reason", None) or e).split()) or type(e).__name__


def _version(sec: dict[str, Any], key: str, default: str, where: str) -> ssl.TLSVersion:
    name = _str(sec, key, "tls_server_config", where) or default
    if name not in _TLS_VERSIONS:
        raise WebConfigError(
            f"{where}: tls_server_config.{key} {name!r}; expected one of "
            + ", ".join(_TLS_VERSIONS)
        )
    return _TLS_VERSIONS[name]


def _resolve(base: str, path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(base, path)


def _users(value: Any, where: str) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: basic_auth_users must map user names to bcrypt hashes")
    if len(value) > MAX_USERS:
        raise WebConfigError(
            f"{where}: {len(value)} basic_auth_users, expected at most {MAX_USERS}"
        )
    users = {}
    for user, hashed in value.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(
                f"{where}: basic_auth_users: user {user!r} must be a non-empty string without ':'"
            )
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(
                f"{where}: basic_auth_users.{user}: expected a bcrypt hash ($2b$12$ and 53 "
                "characters, e.g. from htpasswd -nBC 12), not a password"
            )
        users[user] = hashed.encode("ascii")
    return users


def _http(value: Any, where: str) -> None:
    sec = _section(value, "http_server_config", where)
    for key, v in sec.items():
        if key != "http2":
            raise WebConfigError(f"{where}: unknown key http_server_config.{key}")
        if not isinstance(v, bool):
            raise WebConfigError(f"{where}: http_server_config.http2 must be true or false")
        # kvledger serves HTTP/1.1 only: http2 true or false, the answer is the same.


def for_server(path: str | None, token: str | None) -> WebConfig:
    """The `--web.config.file` (an empty WebConfig without one); UsageError, one line."""
    from exporter.server import basicauth

    if path is None:
        return WebConfig(path="")
    try:
        web = load(path)
    except WebConfigError as e:
        raise UsageError(str(e)) from None
    if web.users and not basicauth.available():
        raise UsageError(f"{FLAG} {path}: {basicauth.INSTALL_HINT}")
    if web.users and token is not None:
        raise UsageError(
            f"{FLAG} {path} has basic_auth_users, which guard every path, /debug/* included: "
            "give no bearer token with it (--token-file, $KVLEDGER_TOKEN)"
        )
    return web
