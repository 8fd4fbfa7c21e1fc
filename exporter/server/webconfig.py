"""`kvledger serve --web.config.file FILE`: TLS and basic auth in the Prometheus exporters' format.

The file is the web configuration of Prometheus's exporter-toolkit, which node_exporter
and dcgm-exporter read (YAML):

    tls_server_config:
      cert_file: server.crt        # relative paths are relative to this file's folder
      key_file: server.key
      client_ca_file: ca.crt       # optional, with client_auth_type
      client_auth_type: RequireAndVerifyClientCert   # or VerifyClientCertIfGiven, NoClientCert
      min_version: TLS12           # TLS12 or TLS13 (TLS10, TLS11: see below); default TLS12
      max_version: TLS13
    basic_auth_users:
      prometheus: $2b$12$...       # bcrypt hashes (htpasswd -nBC 12 "" | tr -d ':\\n')

Either section may be left out. A key kvledger does not implement (cipher_suites,
curve_preferences, http_server_config.headers, client auth types Python's ssl cannot
do) is refused by name rather than ignored, as exporter-toolkit refuses unknown keys.

Read by `exporter.server.private_file`, as the token file is (`exporter.server.token`): every file
(the config, certificates, key) must be a regular file of this user or root that neither
its group nor others can write, read with a bound; the private key must not be readable by
others either (mode 0600 or 0640). The TLS context is loaded from the descriptor that was
checked (`/proc/self/fd/N`), so the file checked is the file loaded. Every refusal is a
`WebConfigError`, one line naming the file and the rule. Nothing secret is ever taken from
the command line.

Links are resolved, not refused: Kubernetes mounts a secret as links (`web.yml ->
..data/web.yml -> ..2024_01_01_00_00_00.1/web.yml`), so refusing them would refuse the
usual deployment. The rules above are checked on what the link leads to (the descriptor
opened), never on the link. A link may therefore lead to a file that passes them and is
no web config at all (`/etc/shadow` is root's and mode 0640): it is refused as such, and no
refusal ever quotes the file's content. What a refusal shows of the file is bounded
(`_shown`): a key, a user name or a value at most `MAX_SHOWN` characters, repr-escaped and
cut with an ellipsis, and none that holds ':' or '$' (every line of /etc/shadow,
/etc/passwd or an htpasswd file does; no key of a web config does); a position is a line
and a column.

The YAML is read as exporter-toolkit's strict reader reads it, within bounds
(`exporter.server.strict_yaml`): at most `MAX_CONFIG_BYTES`, nested at most `MAX_DEPTH`
deep (checked before PyYAML's recursive composer goes a level deeper, so no depth reaches
Python's recursion limit), every key a plain scalar, no key twice in one mapping, no merge
key (`<<`, whose chains PyYAML follows recursively). A value that PyYAML cannot build (a
date of month 13, an integer of thousands of digits) is refused in one line too.

The certificate (the first in cert_file, the one served) must be valid now (its dates
read by `exporter.server.certdates`): an expired certificate, or one not valid yet, is
refused at start, as clients would refuse it; so is a key_file that is not the
certificate's private key. TLS below 1.2 (`min_version` TLS10 or TLS11) is refused unless
`KVLEDGER_ALLOW_OLD_TLS=1` is set in the environment (`ALLOW_OLD_TLS`); Python's default
cipher list has no TLS 1.0/1.1 suite anyway, so the opt-in only lets a config shared with
node_exporter load. A bcrypt cost below
`MIN_BCRYPT_COST` is accepted with a warning naming the users (never the hash).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from exporter.server import private_file, strict_yaml
from exporter.server.certdates import validity
from exporter.server.errors import UsageError
from exporter.server.private_file import ModeRule

log = logging.getLogger(__name__)

FLAG = "--web.config.file"
MAX_CONFIG_BYTES = 64 << 10
MAX_PEM_BYTES = 1 << 20
MAX_USERS = 1024
MAX_DEPTH = 32  # nesting of the YAML (a web config needs 3: file, section, value)
MAX_SHOWN = 40  # characters of a key, user name or value that a refusal may show
MAX_PATH = 4096  # characters of a path named in the file (PATH_MAX)
MIN_BCRYPT_COST = 10  # below: accepted, with a warning
ALLOW_OLD_TLS = "KVLEDGER_ALLOW_OLD_TLS"  # "1": min_version TLS10 or TLS11 is accepted
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


# -- what a refusal may show of the file ------------------------------------------------------

_HIDDEN = re.compile(r"[:$]")


def _shown(value: object) -> str:
    """`value` (a key, a user name, a value read from the file) as a refusal may show it:
    a string repr-escaped and cut to MAX_SHOWN characters with an ellipsis, unless it holds
    ':' or '$' (a line of /etc/shadow, /etc/passwd or an htpasswd file, never a web config's
    key), then not at all; a small number or a boolean as itself; anything else by its type."""
    if isinstance(value, str):
        if _HIDDEN.search(value):
            return "<not shown: it holds ':' or '$'>"
        out, used = [], 0
        for ch in value:
            escaped = "\\'" if ch == "'" else repr(ch)[1:-1]
            if used + len(escaped) > MAX_SHOWN:
                out.append("…")
                break
            out.append(escaped)
            used += len(escaped)
        return "'" + "".join(out) + "'"
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int) and value.bit_length() <= 64:
        return repr(value)
    return f"<a {type(value).__name__}>"


_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_SHOWN}}}")


def _dotted(section: str, key: object) -> str:
    """`section.key` for a key that is a plain name (as a web config's keys are), else
    `section[<the key as _shown shows it>]`."""
    if isinstance(key, str) and _NAME.fullmatch(key):
        return f"{section}.{key}"
    return f"{section}[{_shown(key)}]"


# -- the YAML, read within bounds (exporter.server.strict_yaml) ---------------------------------


def _parse(data: bytes, where: str) -> Any:
    """The document in `data`; WebConfigError (one line, no content) on any fault."""
    try:
        return strict_yaml.parse(data, max_depth=MAX_DEPTH, show=_shown)
    except strict_yaml.StrictYamlError as e:
        raise WebConfigError(f"{where}: {e}") from None


# -- the certificate's validity dates (read by exporter.server.certdates) ------------------------


def _check_validity(pem: bytes, where: str, now: datetime | None = None) -> None:
    try:
        not_before, not_after = validity(pem)
    except (ValueError, UnicodeDecodeError) as e:
        # OpenSSL loaded it, so it is a certificate: the dates are left to the clients.
        log.warning("%s: validity dates not read (%s); not checked", where, e)
        return
    now = now or datetime.now(timezone.utc)
    if now > not_after:
        raise WebConfigError(
            f"{where}: the certificate expired {not_after:%Y-%m-%d %H:%M:%S} UTC (notAfter); "
            "clients refuse it: renew it"
        )
    if now < not_before:
        raise WebConfigError(
            f"{where}: the certificate is not valid before {not_before:%Y-%m-%d %H:%M:%S} UTC "
            "(notBefore); clients refuse it: check this host's clock or the certificate"
        )


# -- the web config ------------------------------------------------------------------------------


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
    doc = _parse(data, where)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise WebConfigError(f"{where}: expected a mapping of tls_server_config, basic_auth_users")
    known = {"tls_server_config", "basic_auth_users", "http_server_config"}
    for key in doc:
        if key not in known:
            raise WebConfigError(
                f"{where}: unknown key {_shown(key)}; expected tls_server_config, "
                "basic_auth_users or http_server_config"
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


def _path(section: dict[str, Any], key: str, base: str, where: str) -> str | None:
    """A file named by `tls_server_config.<key>`, relative to the config's folder; shown whole
    in refusals (the operator must find it), so it must be printable and at most MAX_PATH."""
    value = _str(section, key, "tls_server_config", where)
    if value is None:
        return None
    if not value.isprintable() or len(value) > MAX_PATH:
        raise WebConfigError(
            f"{where}: tls_server_config.{key} {_shown(value)} is not a path (printable, "
            f"at most {MAX_PATH} characters)"
        )
    return value if os.path.isabs(value) else os.path.join(base, value)


def _tls(value: Any, base: str, where: str) -> ssl.SSLContext | None:
    sec = _section(value, "tls_server_config", where)
    if not sec:
        return None
    for unknown in sec:
        if unknown not in _TLS_KEYS:
            raise WebConfigError(
                f"{where}: unknown key {_dotted('tls_server_config', unknown)}; expected one of "
                + ", ".join(sorted(_TLS_KEYS))
            )
    name = "tls_server_config"
    cert_path = _path(sec, "cert_file", base, where)
    key_path = _path(sec, "key_file", base, where)
    if cert_path is None or key_path is None:
        raise WebConfigError(f"{where}: {name} needs both cert_file and key_file")
    auth_name = _str(sec, "client_auth_type", name, where) or "NoClientCert"
    if auth_name not in _CLIENT_AUTH:
        raise WebConfigError(
            f"{where}: {name}.client_auth_type {_shown(auth_name)} is not supported; "
            "expected one of " + ", ".join(_CLIENT_AUTH)
        )
    ca_path = _path(sec, "client_ca_file", base, where)
    if _CLIENT_AUTH[auth_name] != ssl.CERT_NONE and ca_path is None:
        raise WebConfigError(f"{where}: {name}.client_auth_type {auth_name} needs client_ca_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    lowest = _version(sec, "min_version", "TLS12", where)
    highest = _version(sec, "max_version", "TLS13", where)
    if lowest > highest:
        raise WebConfigError(f"{where}: {name}.min_version is above max_version")
    if lowest < ssl.TLSVersion.TLSv1_2:
        _old_tls(sec["min_version"], where)
    with warnings.catch_warnings():
        # Python deprecates TLS 1.0 and 1.1; allowed above by KVLEDGER_ALLOW_OLD_TLS=1 only.
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = lowest
        ctx.maximum_version = highest
    cert_where = f"{where}: cert_file {cert_path}"
    with (
        _checked(cert_path, cert_where, MAX_PEM_BYTES, secret=False) as (cert_pem, cert_fd),
        _checked(key_path, f"{where}: key_file {key_path}", MAX_PEM_BYTES, secret=True) as (
            _,
            key_fd,
        ),
    ):
        try:
            ctx.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}")
        except (ssl.SSLError, OSError) as e:
            if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH":
                raise WebConfigError(
                    f"{where}: key_file {key_path} is not the private key of cert_file "
                    f"{cert_path} (key values mismatch)"
                ) from None
            raise WebConfigError(
                f"{where}: cert_file {cert_path} and key_file {key_path} do not load as a PEM "
                f"certificate and its private key ({_reason(e)})"
            ) from None
        _check_validity(cert_pem, cert_where)
    if ca_path is not None:
        with _checked(
            ca_path, f"{where}: client_ca_file {ca_path}", MAX_PEM_BYTES, secret=False
        ) as (data, _):
            try:
                ctx.load_verify_locations(cadata=data.decode("ascii"))
            except UnicodeDecodeError:
                raise WebConfigError(
                    f"{where}: client_ca_file {ca_path} is not PEM certificates (not ASCII)"
                ) from None
            except (ssl.SSLError, ValueError) as e:
                raise WebConfigError(
                    f"{where}: client_ca_file {ca_path} is not PEM certificates ({_reason(e)})"
                ) from None
    ctx.verify_mode = _CLIENT_AUTH[auth_name]
    return ctx


def _old_tls(name: str, where: str) -> None:
    """min_version TLS10 or TLS11: refused unless KVLEDGER_ALLOW_OLD_TLS=1."""
    if os.environ.get(ALLOW_OLD_TLS) != "1":
        raise WebConfigError(
            f"{where}: tls_server_config.min_version {name} allows TLS below 1.2, which "
            f"kvledger refuses: give TLS12 or TLS13, or set {ALLOW_OLD_TLS}=1 to accept it"
        )
    log.warning(
        "%s: tls_server_config.min_version %s accepted (%s=1); Python's ssl offers no "
        "TLS 1.0/1.1 cipher suite, so such clients still fail",
        where,
        name,
        ALLOW_OLD_TLS,
    )


def _reason(e: BaseException) -> str:
    return " ".join(str(getattr(e, "reason", None) or e).split()) or type(e).__name__


def _version(sec: dict[str, Any], key: str, default: str, where: str) -> ssl.TLSVersion:
    name = _str(sec, key, "tls_server_config", where) or default
    if name not in _TLS_VERSIONS:
        raise WebConfigError(
            f"{where}: tls_server_config.{key} {_shown(name)}; expected one of "
            + ", ".join(_TLS_VERSIONS)
        )
    return _TLS_VERSIONS[name]


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
    cheap: list[tuple[str, int]] = []
    for user, hashed in value.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(
                f"{where}: basic_auth_users: user {_shown(user)} must be a non-empty string "
                "without ':'"
            )
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(
                f"{where}: basic_auth_users: user {_shown(user)}: expected a bcrypt hash "
                "($2b$12$ and 53 characters, e.g. from htpasswd -nBC 12), not a password"
            )
        cost = int(hashed[4:6])
        if cost < MIN_BCRYPT_COST:
            cheap.append((user, cost))
        users[user] = hashed.encode("ascii")
    if cheap:
        named = ", ".join(f"{_shown(u)} (cost {c})" for u, c in cheap[:5])
        more = f" and {len(cheap) - 5} more" if len(cheap) > 5 else ""
        log.warning(
            "%s: basic_auth_users: bcrypt cost below %d for %s%s: a copy of the file is "
            "cheap to crack; hash again with htpasswd -nBC 12",
            where,
            MIN_BCRYPT_COST,
            named,
            more,
        )
    return users


def _http(value: Any, where: str) -> None:
    sec = _section(value, "http_server_config", where)
    for key, v in sec.items():
        if key != "http2":
            raise WebConfigError(f"{where}: unknown key {_dotted('http_server_config', key)}")
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
