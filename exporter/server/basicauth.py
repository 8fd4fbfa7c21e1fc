"""HTTP basic auth with bcrypt hashes, as Prometheus exporters check it (exporter-toolkit).

`BasicAuth(app, users)` wraps an ASGI app: every HTTP request needs
`Authorization: Basic ...` naming a user of `users` (name -> bcrypt hash) and its
password; anything else gets 401 with `WWW-Authenticate: Basic` (a WebSocket handshake
without them is closed before it is accepted). Lifespan events pass through. The only importer of
`bcrypt` (the optional extra `kvledger[tls]`).

A bcrypt check costs tens of milliseconds by design, so it never runs in the event
loop: it runs in a worker thread, at most `max_checks` at once (a flood of wrong
passwords queues there and cannot take every thread). A user and password that passed
are remembered, as an HMAC under a key of this process (never the password itself),
so Prometheus's scrape every few seconds costs one check, not one per scrape. An
unknown user is checked against a hash too, so the answer takes as long as for a
known one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

bcrypt: Any
try:
    import bcrypt
except ImportError:  # pragma: no cover - the optional extra is missing
    bcrypt = None

REALM = "kvledger"
MAX_REMEMBERED = 256
MAX_HEADER = 4096
INSTALL_HINT = "basic_auth_users needs the bcrypt package: pip install 'kvledger[tls]'"


def available() -> bool:
    return bcrypt is not None


def hash_password(password: str, rounds: int = 12) -> str:
    """A bcrypt hash for `basic_auth_users` (what `htpasswd -nBC 12` writes)."""
    if bcrypt is None:
        raise RuntimeError(INSTALL_HINT)
    return str(bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode("ascii"))


class BasicAuth:
    def __init__(self, app: Any, users: Mapping[str, bytes], *, max_checks: int = 2) -> None:
        if bcrypt is None:
            raise RuntimeError(INSTALL_HINT)
        if not users:
            raise ValueError("BasicAuth: no users, expected at least one user and bcrypt hash")
        self.app = app
        self.users = dict(users)
        # A hash of the same cost as the users' for unknown names (same time to say no).
        rounds = int(next(iter(self.users.values()))[4:6])
        self._decoy = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds))
        self._key = secrets.token_bytes(32)
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._limit = anyio.CapacityLimiter(max_checks)
        self._challenge = f'Basic realm="{REALM}", charset="UTF-8"'.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "websocket" and not await self.allowed(_authorization(scope)):
            await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
            return
        if kind == "http" and not await self.allowed(_authorization(scope)):
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"www-authenticate", self._challenge),
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", b"13"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b"Unauthorized\n"})
            return
        await self.app(scope, receive, send)

    async def allowed(self, header: bytes | None) -> bool:
        creds = _credentials(header)
        if creds is None:
            return False
        user, password = creds
        mark = hmac.new(self._key, user + b"\0" + password, hashlib.sha256).digest()
        if mark in self._passed:
            self._passed.move_to_end(mark)
            return True
        name = user.decode("utf-8", "replace")
        hashed = self.users.get(name)
        ok = await anyio.to_thread.run_sync(
            _check, password, hashed if hashed is not None else self._decoy, limiter=self._limit
        )
        if not (ok and hashed is not None):
            return False
        self._passed[mark] = None
        if len(self._passed) > MAX_REMEMBERED:
            self._passed.popitem(last=False)
        return True


def _check(password: bytes, hashed: bytes) -> bool:
    try:
        return bool(bcrypt.checkpw(password, hashed))
    except ValueError:  # e.g. a password longer than bcrypt's 72 bytes
        return False


def _authorization(scope: Any) -> bytes | None:
    for key, value in scope["headers"]:
        if key == b"authorization":
            return bytes(value)
    return None


def _credentials(header: bytes | None) -> tuple[bytes, bytes] | None:
    if header is None or len(header) > MAX_HEADER:
        return None
    scheme, _, encoded = header.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        raw = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    if not sep or not user:
        return None
    return user, password
