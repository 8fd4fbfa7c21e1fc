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

The places in that queue are shared between clients, a client being the peer address of
the connection (what uvicorn reports: the TCP peer, never a forwarded-for header, which
the sender writes). One client holds at most `max_per_client` of them; a request past
that gets the 503. A client whose last check failed (within `SUSPECT_SECONDS`, and no
check of its own has passed since) is a suspect. When every place is taken, a request
takes the place of the newest request still waiting for its check of a client ranked
below it, which gets the 503 instead: a suspect ranks below a client that is not one,
and between two of the same kind, the client holding the most places ranks below one
holding fewer (less one). So a flood of new passwords from a few addresses, or from
many addresses that have each failed once, cannot keep a credential not seen before
(Prometheus after a restart) out; a flood from more fresh addresses than the queue has
places still can, for as long as it finds fresh ones. Behind a reverse proxy every
request comes from the proxy's address and shares one client's places: authenticate at
the proxy, or accept that.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
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
MAX_PER_CLIENT = 4  # places in the check queue (running or waiting) one client may hold
SUSPECT_SECONDS = 600.0  # how long a failed check ranks its client below the others
MAX_SUSPECTS = 4096  # clients remembered as suspects (the oldest forgotten first)
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
        max_per_client: int = MAX_PER_CLIENT,
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
        self._per_client = max(1, min(max_per_client, self._max_checking))
        self._queue = _CheckQueue()
        self._suspects = _Suspects()
        self.busy = 0  # requests answered 503: too many waiting for a check
        self.displaced = 0  # of those, waiting ones whose place another client's request took
        self._challenge = f'Basic realm="{REALM}", charset="UTF-8"'.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = _authorization(scope)
        client = _client(scope)
        if kind == "websocket":
            admitted = not self._must_wait(header) or self._admit(client)
            if admitted and await self.allowed(header, client):
                await self.app(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008})  # before accept: 403
            return
        if self._must_wait(header) and not self._admit(client):
            await self._busy(send)
            return
        passed = await self._check(header, client)
        if passed is None:  # its place was taken by another client's request
            self.displaced += 1
            await self._busy(send)
            return
        if not passed:
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

    async def _busy(self, send: Any) -> None:
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

    @property
    def checking(self) -> int:
        """Requests running or waiting for a check now."""
        return self._queue.total

    def _admit(self, client: str) -> bool:
        """Whether a request of `client` may wait for a check: under its share and the cap,
        or by displacing the newest waiting request of a client ranked below it."""
        q = self._queue
        held = q.held(client)
        if held >= self._per_client:
            return False
        if q.total < self._max_checking:
            return True
        return q.displace(client, is_suspect=self._suspects.now)

    def _mark(self, user: bytes, password: bytes) -> bytes:
        return hmac.new(self._key, user + b"\0" + password, hashlib.sha256).digest()

    def _must_wait(self, header: bytes | None) -> bool:
        """Whether this header's answer needs a bcrypt check (not remembered either way)."""
        creds = _credentials(header)
        if creds is None:
            return False
        mark = self._mark(*creds)
        return mark not in self._passed and mark not in self._failed

    async def allowed(self, header: bytes | None, client: str = "") -> bool:
        """Whether `header` names a user and its password (False too when displaced)."""
        return bool(await self._check(header, client))

    async def _check(self, header: bytes | None, client: str) -> bool | None:
        """Whether `header` names a user and its password; None when this request's place in
        the check queue was taken by another client's request before its check began."""
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
        entry = self._queue.enter(client)
        try:
            with entry.scope:
                await anyio.to_thread.run_sync(
                    entry.run,
                    password,
                    hashed if hashed is not None else self._decoy,
                    limiter=self._limit,
                )
        finally:
            self._queue.leave(entry)
        if entry.result is None:  # displaced while it waited for a thread
            return None
        passed = entry.result and hashed is not None
        self._suspects.record(client, failed=not passed)
        remembered = self._passed if passed else self._failed
        remembered[mark] = None
        if len(remembered) > MAX_REMEMBERED:
            remembered.popitem(last=False)
        return passed


class _Entry:
    """One request in the check queue: its client, the scope that cancels its wait, and
    the check's result once it ran."""

    __slots__ = ("client", "gone", "result", "scope", "started")

    def __init__(self, client: str) -> None:
        self.client = client
        self.scope = anyio.CancelScope()
        self.started = False  # set in the worker thread as the check begins
        self.result: bool | None = None
        self.gone = False  # left the queue (displaced, or done)

    def run(self, password: bytes, hashed: bytes) -> None:
        self.started = True
        self.result = _check(password, hashed)


class _CheckQueue:
    """The requests running or waiting for a check, by client (event loop only)."""

    def __init__(self) -> None:
        self.total = 0
        self._by_client: dict[str, list[_Entry]] = {}

    def held(self, client: str) -> int:
        return len(self._by_client.get(client, ()))

    def enter(self, client: str) -> _Entry:
        entry = _Entry(client)
        self._by_client.setdefault(client, []).append(entry)
        self.total += 1
        return entry

    def leave(self, entry: _Entry) -> None:
        if entry.gone:
            return
        entry.gone = True
        held = self._by_client[entry.client]
        held.remove(entry)
        if not held:
            del self._by_client[entry.client]
        self.total -= 1

    def displace(self, client: str, *, is_suspect: Callable[[str], bool]) -> bool:
        """For a request of `client`: cancel the newest waiting request (a running check is
        never cut short) of the lowest-ranked client ranked below it (a suspect below one
        that is not; then the most places below fewer, by more than one). True when a place
        was freed."""
        suspect, held = is_suspect(client), self.held(client)
        ranked = sorted(
            (
                (is_suspect(client), len(entries), entries)
                for client, entries in self._by_client.items()
            ),
            key=lambda r: (r[0], r[1]),
            reverse=True,
        )
        for victim_suspect, victim_held, entries in ranked:
            below = (victim_suspect and not suspect) or (
                victim_suspect == suspect and victim_held > held + 1
            )
            if not below:
                continue
            for entry in reversed(entries):
                if not entry.started:
                    entry.scope.cancel()
                    self.leave(entry)  # its place is free now; the cancelled wait ends soon
                    return True
        return False


class _Suspects:
    """Clients whose last check failed, for `SUSPECT_SECONDS` (event loop only; at most
    `MAX_SUSPECTS`, the oldest forgotten first). A check that passes clears its client."""

    def __init__(self) -> None:
        self._since: OrderedDict[str, float] = OrderedDict()

    def record(self, client: str, *, failed: bool) -> None:
        if not failed:
            self._since.pop(client, None)
            return
        self._since[client] = time.monotonic()
        self._since.move_to_end(client)
        if len(self._since) > MAX_SUSPECTS:
            self._since.popitem(last=False)

    def now(self, client: str) -> bool:
        since = self._since.get(client)
        if since is None:
            return False
        if time.monotonic() - since > SUSPECT_SECONDS:
            del self._since[client]
            return False
        return True


def _client(scope: Any) -> str:
    """The peer address of the connection (uvicorn's `client`), "" when unknown."""
    peer = scope.get("client")
    return str(peer[0]) if peer else ""


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
