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
- a request with more than `max_headers` header fields is answered 431 and closed;
- a connection with more than `MAX_PIPELINED` requests read ahead of the one being
  answered (httptools parses all that one read brings) is closed; each connection's
  kernel send buffer is `SEND_BUFFER`, not autotuned up to 4 MiB, so a client that does
  not read is noticed after that many bytes of responses, not 4 MiB of them.

`ConnectionGuard` counts what it closed, by reason (`CLOSE_REASONS`; `bad_request`: a
malformed request or a head over the size cap, answered 400 by uvicorn), for
`kvledger_connections_closed_total`. It also says when a crowd of connections has gone
(`connections_gone`): what they held (TLS state, buffers) was freed, but glibc keeps the
freed heap, and the directory scan then gives it back (`exporter.memory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
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
    "too_many_pipelined",
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
# The kernel's send buffer of each connection (Linux doubles it). Left to autotuning it grows
# to net.ipv4.tcp_wmem's maximum (4 MiB): a client that pipelines requests and reads none
# of the answers would have that many bytes of responses made for it, unread, before
# uvicorn's flow control notices. 256 KiB is still ~100 ms of a 20 Mbit/s link's data.
SEND_BUFFER = 128 << 10
# Requests read ahead of the one being answered on one connection (httptools parses every
# request a read brings; each waits as a request object). Prometheus pipelines none.
MAX_PIPELINED = 16
LOG_EVERY_S = 60.0
# Connections closed since the most held at once, and the share of that peak still open at
# most, before the heap they freed is given back (`ConnectionGuard.connections_gone`).
RELEASE_AFTER_CLOSED = 256
RELEASE_BELOW_SHARE = 0.5


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

    def __init__(
        self,
        limits: Limits,
        *,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.tls = tls  # TLS done by the guarded protocol: uvicorn's own ssl stays unset
        self.waiting: OrderedDict[Any, asyncio.TimerHandle] = OrderedDict()
        self.stalled: OrderedDict[Any, asyncio.TimerHandle] = OrderedDict()
        self.unread = 0
        self.unread_budget = UNREAD_BUDGET
        self.closed: dict[str, int] = dict.fromkeys(CLOSE_REASONS, 0)
        self.open = 0
        self.peak = 0  # the most connections held at once since the last release
        self._clock = clock
        self._logged = -LOG_EVERY_S

    def connections_gone(self) -> bool:
        """True (once) when at least `RELEASE_AFTER_CLOSED` connections have closed since
        the most held at once, and at most `RELEASE_BELOW_SHARE` of that peak are still
        open: a flood has ended, and the memory its connections held is free to give back.
        Read from the directory scan's thread (two ints: a stale read delays it a scan)."""
        open_now, peak = self.open, self.peak
        if peak - open_now >= RELEASE_AFTER_CLOSED and open_now <= peak * RELEASE_BELOW_SHARE:
            self.peak = open_now
            return True
        return False

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
        if guard.open > guard.peak:
            guard.peak = guard.open
        self.arm()
        if guard.open > guard.limits.max_connections:
            victim = next((w for w in guard.waiting if w is not self), None)
            if victim is None:
                victim = next(iter(guard.stalled), None)
            if victim is not None:
                victim.drop("evicted")
            else:
                self.disarm()
                if guard.tls is None:
                    transport.write(_REFUSED)
                    transport.close()
                else:  # still in its handshake: nothing in plain HTTP
                    transport.abort()
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
    _http = False  # uvicorn's protocol has its connection (for TLS: after the handshake)
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._watch = _Watch(self._guard, self.loop)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Not a TCP socket (a test's pipe): its own buffer stays.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        # A stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance).
        stream = cast(asyncio.Transport, transport)
        tls = self._guard.tls
        if tls is None:
            self._http = True
            super().connection_made(transport)
            self._watch.opened(stream)
            return
        self._http = False  # uvicorn's protocol has no transport until the handshake is done
        self._watch.opened(stream)
        if stream.is_closing():  # refused
            return
        pending = _Handshaking(self)
        # start_tls runs up to its wait here, inside connection_made, so that its TLS
        # protocol has the transport before the first read: uvloop starts reading once
        # connection_made returns, whatever pause_reading said, and a ClientHello read by
        # the HTTP protocol would be lost. Its handshake timeout is the request timeout,
        # which the watch also holds the handshake and the head together to.
        _run_now(
            self.loop.start_tls(
                stream,
                pending,
                tls,
                server_side=True,
                ssl_handshake_timeout=self._guard.limits.request_timeout,
            ),
            lambda wrapped, exc: self._handshake_done(pending, wrapped, exc),
        )

    def _handshake_done(
        self, pending: _Handshaking, wrapped: Any, exc: BaseException | None
    ) -> None:
        if exc is not None or wrapped is None or wrapped.is_closing():
            # Failed, timed out, closed or evicted: uvicorn's protocol never saw it.
            self._watch.closed()
            return
        self._watch.transport = wrapped
        self._http = True
        super().connection_made(wrapped)
        pending.connected(wrapped)

    def connection_lost(self, exc: Exception | None) -> None:
        self._watch.closed()
        if self._http:
            super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch.write_paused()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._watch.unstall()


def _run_now(
    coro: Coroutine[Any, Any, Any], done: Callable[[Any, BaseException | None], None]
) -> None:
    """Run `coro` now up to its first wait, in this call, and on as each future it waits
    for completes (what Python 3.12's eager tasks do; this is 3.11); then `done(result,
    None)` or `done(None, exception)`. Only for a coroutine that waits on futures alone
    (loop.start_tls waits on one)."""

    def step(_: object = None) -> None:
        try:
            waited = coro.send(None)
        except StopIteration as stop:
            done(stop.value, None)
        except BaseException as e:  # handed to `done`, as a task would keep it
            done(None, e)
        else:
            waited.add_done_callback(step)

    step()


class _Handshaking(asyncio.Protocol):
    """The protocol of a TLS connection from its handshake's end until uvicorn's protocol
    has it: asyncio's and uvloop's TLS deliver what arrived with the handshake's last
    message before `start_tls` returns, so it is kept here and handed on in order."""

    def __init__(self, app: asyncio.Protocol) -> None:
        self.app = app
        self.early: list[bytes] = []
        self.eof = False
        self.lost: tuple[Exception | None] | None = None

    def data_received(self, data: bytes) -> None:
        self.early.append(data)

    def eof_received(self) -> bool | None:
        self.eof = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = (exc,)

    def connected(self, transport: asyncio.Transport) -> None:
        transport.set_protocol(self.app)
        for data in self.early:
            self.app.data_received(data)
        if self.eof:
            self.app.eof_received()
        if self.lost is not None:
            self.app.connection_lost(self.lost[0])


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
                if len(self.pipeline) > MAX_PIPELINED:
                    self._watch.drop("too_many_pipelined")

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
