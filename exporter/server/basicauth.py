"""HTTP basic auth with bcrypt hashes, as Prometheus exporters check it (exporter-toolkit).

`BasicAuth(app, users)` wraps an ASGI app: every HTTP request needs
`Authorization: Basic ...` naming a user of `users` (name -> bcrypt hash) and its
password; anything else gets 401 with `WWW-Authenticate: Basic` (a WebSocket handshake
without them is closed before it is accepted). Lifespan events pass through. The only importer of
`bcrypt` (the optional extra `kvledger[tls]`).

A bcrypt check costs tens of milliseconds by design, so it never runs in the event
loop: it runs in a worker thread, at most `max_checks` at once, and at most `max_waiting`
more requests wait for one; a request past that is answered 503 at once (with
`Retry-After` and `connection: close`), so a flood of wrong passwords neither queues
without end nor holds connections that the cap would count as being answered. A user
and password that passed are remembered, as an HMAC under a key of this process (never
the password itself), so Prometheus's scrape every few seconds costs one check, not one
per scrape, and never waits behind anyone's check; a pair that failed is remembered too
(401 at once, no check: the same wrong password sent again costs nothing). An unknown
user is checked against a hash too, so the answer takes as long as for a known one.
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
MAX_WAITING = 8  # requests waiting for a check beyond the `max_checks` running
BUSY = b"too many password checks\n"
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
    def __init__(
        self,
        app: Any,
        users: Mapping[str, bytes],
        *,
        max_checks: int = 2,
        max_waiting: int = MAX_WAITING,
    ) -> None:
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
        self._failed: OrderedDict[bytes, None] = OrderedDict()
        self._limit = anyio.CapacityLimiter(max_checks)
        self._max_checking = max_checks + max_waiting
        self.checking = 0  # requests running or waiting for a check now
        self.busy = 0  # requests answered 503: too many waiting for a check
        self._challenge = f'Basic realm="{REALM}", charset="UTF-8"'.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "websocket" and not await self.allowed(_authorization(scope)):
            await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
            return
        if kind == "http" and self._must_wait(_authorization(scope)) and self._full():
            self.busy += 1
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"retry-after", b"1"),
                        (b"connection", b"close"),
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", b"%d" % len(BUSY)),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": BUSY})
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

    def _mark(self, user: bytes, password: bytes) -> bytes:
        return hmac.new(self._key, user + b"\0" + password, hashlib.sha256).digest()

    def _must_wait(self, header: bytes | None) -> bool:
        """Whether this header's answer needs a bcrypt check (not remembered either way)."""
        creds = _credentials(header)
        if creds is None:
            return False
        mark = self._mark(*creds)
        return mark not in self._passed and mark not in self._failed

    def _full(self) -> bool:
        return self.checking >= self._max_checking

    async def allowed(self, header: bytes | None) -> bool:
        creds = _credentials(header)
        if creds is None:
            return False
        user, password = creds
        mark = self._mark(user, password)
        if mark in self._passed:
            self._passed.move_to_end(mark)
            return True
        if mark in self._failed:
            self._failed.move_to_end(mark)
            return False
        name = user.decode("utf-8", "replace")
        hashed = self.users.get(name)
        self.checking += 1
        try:
            ok = await anyio.to_thread.run_sync(
                _check,
                password,
                hashed if hashed is not None else self._decoy,
                limiter=self._limit,
            )
        finally:
            self.checking -= 1
        passed = ok and hashed is not None
        remembered = self._passed if passed else self._failed
        remembered[mark] = None
        if len(remembered) > MAX_REMEMBERED:
            remembered.popitem(last=False)
        return passed


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
