"""Connection limits for `kvledger serve`: what a local client may hold, and for how long.

uvicorn's own settings do most of it, and are used where they exist:
`h11_max_incomplete_event_size` caps a request's head (request line and headers),
`limit_concurrency` answers 503 when too many requests are in flight,
`timeout_keep_alive` closes a kept-alive connection that sends nothing more, and
`backlog` bounds how many connections the kernel queues for one accept. What
uvicorn has no setting for is done here, in `guarded_protocol` (a subclass of
uvicorn's h11 protocol, the one foreign API this module speaks):

- a request head not complete within `request_timeout` seconds of the connection
  (or of the previous response) closes the connection, however slowly its bytes
  come; a client sending one byte at a time is closed like one sending nothing;
- at most `max_connections` connections are held, a number kept below the process's
  file-descriptor limit (`fd_budget`), so accepting a connection never fails with
  EMFILE and nothing else in the process (the directory scan) runs out of
  descriptors. A connection past the cap closes the one that has waited longest
  without a complete request (an idle client gives way to a scraper that sends its
  request at once); then the one whose answers have gone unread longest (below);
  when every held connection is being answered and read, the new one is refused with
  503 and closed. A client over a cap is refused, never served late;
- a connection whose answers are not read (its write buffer over the transport's
  high-water mark, so uvicorn's flow control parks the response) is closed once that
  has lasted `request_timeout` seconds, and the ones parked longest are closed as soon
  as all the parked connections' unread bytes add up past `UNREAD_BUDGET`: a client
  that pipelines requests and never reads holds neither a connection nor memory;
- a request with more than `max_headers` header fields is answered 431 and closed.

`ConnectionGuard` counts what it closed, by reason (`CLOSE_REASONS`; `bad_request`: a
malformed request or a head over the size cap, answered 400 by uvicorn), for
`kvledger_connections_closed_total`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from uvicorn.protocols.http.h11_impl import H11Protocol

_HttpToolsProtocol: type[asyncio.Protocol] | None
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpToolsProtocol
except ImportError:  # httptools not installed: uvicorn's h11 protocol is guarded instead
    _HttpToolsProtocol = None

log = logging.getLogger(__name__)

CLOSE_REASONS = (
    "request_timeout",
    "evicted",
    "refused",
    "too_many_headers",
    "bad_request",
    "slow_reader",
)

DEFAULT_HEADER_BYTES = 16 * 1024  # h11's own default; node's and Go's are 16 KiB and 1 MiB
DEFAULT_MAX_HEADERS = 100  # as node's http server
DEFAULT_REQUEST_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_S = 5  # uvicorn's default
DEFAULT_MAX_CONNECTIONS = 1024
BACKLOG = 64  # connections the kernel queues; also the most one accept round takes
# Descriptors kept free for everything but client connections: the directory scan's
# reads, worker threads, the log, the demo's files. Beyond the ones open at start.
FD_RESERVE = 2 * BACKLOG + 128
MIN_CONNECTIONS = 8
# Unread response bytes all parked connections may hold together; past it the connection
# parked longest is closed (one parked connection holds at most one response beyond the
# transport's high-water mark: uvicorn waits for the buffer to drain between writes).
UNREAD_BUDGET = 32 << 20
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class Limits:
    """What one client may hold. `max_connections` counts open client connections."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_bytes: int = DEFAULT_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    keep_alive: int = DEFAULT_KEEP_ALIVE_S

    def __post_init__(self) -> None:
        for name, lo in (
            ("max_connections", 1),
            ("header_bytes", 1024),
            ("max_headers", 1),
            ("keep_alive", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"Limits: {name}={value!r}, expected an integer >= {lo}")
        t = self.request_timeout
        if not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"Limits: request_timeout={t!r}, expected seconds > 0")

    def uvicorn_settings(self) -> dict[str, Any]:
        """uvicorn.Config keyword arguments for these limits (with `guarded_protocol`)."""
        return {
            "h11_max_incomplete_event_size": self.header_bytes,
            "timeout_keep_alive": self.keep_alive,
            # In-flight requests; connections past max_connections are handled here first,
            # so uvicorn's check (which counts connections too) only sees the few a burst of
            # accepts holds before they are settled.
            "limit_concurrency": self.max_connections + 2 * BACKLOG,
            "backlog": BACKLOG,
        }


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; returns (soft, hard)
    as they are afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def open_fds() -> int:
    """Descriptors open in this process now (Linux /proc; a guess of 64 elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def fd_budget(soft_limit: int, in_use: int) -> int:
    """The most client connections that fit under `soft_limit` with `in_use` descriptors
    open and FD_RESERVE kept free."""
    if soft_limit == resource.RLIM_INFINITY:
        soft_limit = 1 << 20
    return soft_limit - in_use - FD_RESERVE


class ConnectionGuard:
    """The shared state of one server's connections: those waiting for a complete request
    head, oldest first; those whose answers go unread (`stalled`), longest first, and the
    bytes they hold unread; and the counts of connections closed by reason."""

    def __init__(self, limits: Limits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.waiting: OrderedDict[Any, asyncio.TimerHandle] = OrderedDict()
        self.stalled: OrderedDict[Any, asyncio.TimerHandle] = OrderedDict()
        self.unread = 0
        self.unread_budget = UNREAD_BUDGET
        self.closed: dict[str, int] = dict.fromkeys(CLOSE_REASONS, 0)
        self.open = 0
        self._clock = clock
        self._logged = -LOG_EVERY_S

    def count(self, reason: str) -> None:
        """Count a connection closed for `reason`; one log line per LOG_EVERY_S at most."""
        self.closed[reason] += 1
        now = self._clock()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning(
                "closed a client connection (%s); closed so far: %s (next line in %g s at most)",
                reason,
                ", ".join(f"{k} {v}" for k, v in self.closed.items() if v),
                LOG_EVERY_S,
            )


_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 21\r\n\r\ntoo many connections\n"
)
_TOO_MANY_HEADERS = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8"
    b"\r\nconnection: close\r\ncontent-length: 18\r\n\r\ntoo many headers.\n"
)


class _Watch:
    """One connection's part of its guard, for either protocol: its place among the
    connections waiting for a request head, and the timer that closes it when the head does
    not come in time. The protocol tells it when the connection opens and closes, when a
    head is complete and when a response is; it counts what it closes."""

    def __init__(self, guard: ConnectionGuard, loop: asyncio.AbstractEventLoop) -> None:
        self.guard = guard
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.head_bytes = 0  # received since the head was awaited (kept for httptools)
        self.unread = 0  # bytes in the write buffer when it went over the high-water mark
        self.is_closed = False

    @property
    def waiting_for_head(self) -> bool:
        return self in self.guard.waiting

    def opened(self, transport: asyncio.Transport) -> None:
        """A new connection: wait for its head; past the cap, close the connection that has
        waited longest for one, or refuse this one with 503 when none is waiting."""
        guard = self.guard
        self.transport = transport
        guard.open += 1
        self.arm()
        if guard.open > guard.limits.max_connections:
            victim = next((w for w in guard.waiting if w is not self), None)
            if victim is None:
                victim = next(iter(guard.stalled), None)
            if victim is not None:
                victim.drop("evicted")
            else:
                self.disarm()
                transport.write(_REFUSED)
                transport.close()
                guard.count("refused")

    def closed(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self.guard.open -= 1
        self.disarm()
        self.unstall()

    def write_paused(self) -> None:
        """The write buffer went over the high-water mark: the client is not reading. Closed
        if it stays so for `request_timeout`, or sooner when the parked connections' unread
        bytes pass the budget (the longest parked first)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self in self.guard.stalled:
            return
        guard = self.guard
        self.unread = transport.get_write_buffer_size()
        guard.unread += self.unread
        guard.stalled[self] = self.loop.call_later(
            guard.limits.request_timeout, self.drop, "slow_reader"
        )
        while guard.unread > guard.unread_budget and guard.stalled:
            next(iter(guard.stalled)).drop("slow_reader")

    def unstall(self) -> None:
        timer = self.guard.stalled.pop(self, None)
        if timer is not None:
            timer.cancel()
            self.guard.unread -= self.unread
            self.unread = 0

    def head_complete(self, headers: int) -> bool:
        """A request head came in: True when it is to be answered now. False on a closing
        connection, and when it has more than `max_headers` header fields (answered 431 and
        closed)."""
        self.disarm()
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if headers > self.guard.limits.max_headers:
            transport.write(_TOO_MANY_HEADERS)
            transport.close()
            self.guard.count("too_many_headers")
            return False
        return True

    def bad_request(self) -> None:
        """A malformed request, or a head over the size cap, answered 400 by uvicorn."""
        self.disarm()
        self.guard.count("bad_request")

    def response_complete(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.arm()  # the next request's head must come in time too

    def head_over_cap(self, received: int) -> bool:
        """`received` bytes came while a head is awaited: True once they add up past
        `header_bytes` since it was (the connection's start or the last response)."""
        self.head_bytes += received
        return self.head_bytes > self.guard.limits.header_bytes

    def arm(self) -> None:
        self.disarm()
        self.head_bytes = 0
        self.guard.waiting[self] = self.loop.call_later(
            self.guard.limits.request_timeout, self.drop, "request_timeout"
        )

    def disarm(self) -> None:
        timer = self.guard.waiting.pop(self, None)
        if timer is not None:
            timer.cancel()

    def drop(self, reason: str) -> None:
        self.disarm()
        self.unstall()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.abort()
            self.guard.count(reason)


class _Watched(asyncio.Protocol):
    """What both guarded protocols do when a connection opens and closes: a `_Watch` of
    `_guard` for it, told of both. Put first in the bases of a uvicorn protocol subclass
    that sets `_guard`."""

    _guard: ConnectionGuard
    _watch: _Watch
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._watch = _Watch(self._guard, self.loop)
        super().connection_made(transport)
        # A stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance).
        self._watch.opened(cast(asyncio.Transport, transport))

    def connection_lost(self, exc: Exception | None) -> None:
        self._watch.closed()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch.write_paused()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._watch.unstall()


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol held to `guard`'s limits (pass as `uvicorn.Config(http=...)`,
    with `guard.limits.uvicorn_settings()`): its httptools protocol, which uvicorn itself
    picks when httptools is installed (a C parser: about 0.3-0.45 ms less of the event loop's
    time a request than h11's, docs/benchmarks-history.md), else its h11 one."""
    if _HttpToolsProtocol is not None:
        return guarded_httptools(guard)
    return guarded_h11(guard)


def guarded_h11(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol held to `guard`'s limits. h11 caps the head's size itself
    (`h11_max_incomplete_event_size`, answered 400)."""

    class GuardedH11Protocol(_Watched, H11Protocol):
        _guard = guard

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            # A request head came in: it is answered now, unless the watch refused it. Then
            # its task has started; it finds the transport closed and sends nothing.
            if self.cycle is not before and not self._watch.head_complete(len(self.headers)):
                self.cycle.disconnected = True

        def send_400_response(self, msg: str) -> None:
            self._watch.bad_request()
            super().send_400_response(msg)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:
                self._watch.response_complete()

    return GuardedH11Protocol


def guarded_httptools(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol held to `guard`'s limits. httptools has no cap on a
    head's size, so it is kept here: the bytes received while a head is awaited, counted
    from the connection's start or the last response, over `header_bytes` with the head
    still incomplete close the connection with 400, as h11's cap does. A head complete
    within the bytes read at once is parsed whatever its size, as h11 parses it."""
    if _HttpToolsProtocol is None:
        raise RuntimeError("guarded_httptools: httptools is not installed")

    class GuardedHttpToolsProtocol(_Watched, _HttpToolsProtocol):  # type: ignore[misc, valid-type]
        _guard = guard

        def data_received(self, data: bytes) -> None:
            watch = self._watch
            counting = watch.waiting_for_head
            super().data_received(data)
            if (
                counting
                and watch.waiting_for_head  # the head is still incomplete
                and not self.transport.is_closing()
                and watch.head_over_cap(len(data))
            ):
                self.send_400_response("Request head over the size cap.")

        def on_headers_complete(self) -> None:
            if self._watch.head_complete(len(self.headers)):
                super().on_headers_complete()

        # A refused head starts no request: what the parser reads after it is not the app's.
        def on_body(self, body: bytes) -> None:
            if not self.transport.is_closing():
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.transport.is_closing():
                super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            self._watch.bad_request()
            super().send_400_response(msg)

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # then the next request's head is in already
            super().on_response_complete()
            if not pipelined:
                self._watch.response_complete()

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            self._running = cycle
            super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc: Exception | None) -> None:
            # uvicorn marks only the last request read (`self.cycle`) disconnected: with
            # requests pipelined, the one being answered, parked in the flow control's
            # drain, would wake up and write to the closed transport (a RuntimeError
            # traceback under uvloop). Every unanswered one is told.
            cycles = [getattr(self, "_running", None), *(c for c, _ in self.pipeline)]
            super().connection_lost(exc)
            for cycle in cycles:
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()

    return GuardedHttpToolsProtocol


def limits_from(
    max_connections: int | None,
    *,
    header_bytes: int,
    max_headers: int,
    request_timeout: float,
    keep_alive: int,
    soft_limit: int,
    in_use: int,
    error: Callable[[str], Exception],
) -> Limits:
    """The Limits for `kvledger serve`'s flags: `max_connections` None means as many as
    the descriptors allow, at most DEFAULT_MAX_CONNECTIONS; an explicit number over what
    they allow raises `error(one line)`."""
    budget = fd_budget(soft_limit, in_use)
    if max_connections is None:
        n = min(DEFAULT_MAX_CONNECTIONS, budget)
        if n < MIN_CONNECTIONS:
            raise error(
                f"file-descriptor limit {soft_limit} with {in_use} in use leaves {budget} "
                f"for client connections; expected at least {MIN_CONNECTIONS} "
                "(raise `ulimit -n`)"
            )
    else:
        if max_connections > budget:
            raise error(
                f"--max-connections {max_connections}: over what the file-descriptor limit "
                f"allows (soft limit {soft_limit}, {in_use} in use, {FD_RESERVE} kept free); "
                f"expected at most {budget}"
            )
        n = max_connections
    return Limits(
        max_connections=n,
        header_bytes=header_bytes,
        max_headers=max_headers,
        request_timeout=request_timeout,
        keep_alive=keep_alive,
    )
