"""exporter.server.connections on a real uvicorn server (loopback), with each of uvicorn's HTTP
protocols guarded (httptools, what `guarded_protocol` picks when it is installed, and h11):
the connection cap makes room by closing the connection that waited longest without a
request, refuses a new one with 503 when every held one is being answered (never serving it
late), a head that does not come in time, is too large or has too many fields is refused,
and the limits' arguments are checked. `kvledger serve`'s own guards are tested through the
command in tests/kvledger/test_serve_clients.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from exporter.server import connections
from exporter.server.connections import (
    ConnectionGuard,
    Limits,
    fd_budget,
    guarded_h11,
    guarded_httptools,
    guarded_protocol,
    limits_from,
)
from tests.servers import wait_until

PROTOCOLS = {"httptools": guarded_httptools, "h11": guarded_h11}


class SlowApp:
    """GET /slow waits until `release` is set; anything else answers at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] == "/slow":
            self.in_flight += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        body = b"ok"
        if scope["method"] == "POST":
            more, got = True, 0
            while more:
                message = await receive()
                got += len(message.get("body", b""))
                more = message.get("more_body", False)
            body = b"got %d" % got
        length = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        await send({"type": "http.response.body", "body": body})


class Server:
    def __init__(self, limits: Limits, protocol: str = "httptools") -> None:
        self.app = SlowApp()
        self.guard = ConnectionGuard(limits)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        config = uvicorn.Config(
            self.app,
            log_level="error",
            lifespan="off",
            http=PROTOCOLS[protocol](self.guard),
            **limits.uvicorn_settings(),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def connect(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=5)
        time.sleep(0.05)  # accepted, in this order
        return s


@contextlib.contextmanager
def _running(limits: Limits, protocol: str) -> Iterator[Server]:
    srv = Server(limits, protocol)
    srv.thread.start()
    wait_until(lambda: srv.server.started, 10, "uvicorn started")
    try:
        yield srv
    finally:
        srv.app.release.set()
        srv.server.should_exit = True
        srv.thread.join(10)
        srv.sock.close()


@pytest.fixture(params=sorted(PROTOCOLS))
def protocol(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server(protocol: str) -> Iterator[Server]:
    with _running(Limits(max_connections=4, request_timeout=30), protocol) as srv:
        yield srv


def _closed(s: socket.socket) -> bool:
    s.settimeout(2)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


GET = b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n"


def test_past_the_cap_the_longest_waiting_idle_connection_makes_room(server):
    idle = [server.connect() for _ in range(4)]
    new = server.connect()
    new.sendall(GET % b"fast")
    assert new.recv(1024).startswith(b"HTTP/1.1 200")
    assert _closed(idle[0])  # the oldest gave way
    for s in idle[1:]:
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):
            s.recv(1)  # the others are still open
    assert server.guard.closed["evicted"] == 1
    for s in [*idle, new]:
        s.close()


def test_past_the_cap_with_every_connection_answered_a_new_one_is_refused_not_served_late(server):
    busy = [server.connect() for _ in range(4)]
    for s in busy:
        s.sendall(GET % b"slow")
    wait_until(lambda: server.app.in_flight == 4, 5, "four requests in flight")
    t0 = time.monotonic()
    late = server.connect()
    reply = late.recv(1024)
    assert reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply, reply
    assert time.monotonic() - t0 < 1.0
    late.sendall(GET % b"fast")  # too late: it is closed, never answered
    server.app.release.set()
    assert _closed(late)
    for s in busy:
        assert s.recv(1024).startswith(b"HTTP/1.1 200")  # the held ones are answered
        s.close()
    assert server.guard.closed["refused"] == 1
    late.close()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_connections=0"):
        Limits(max_connections=0)
    with pytest.raises(ValueError, match="request_timeout=nan"):
        Limits(request_timeout=float("nan"))
    with pytest.raises(ValueError, match="header_bytes=10"):
        Limits(header_bytes=10)


def test_the_cap_stays_below_the_fd_limit():
    assert fd_budget(1024, 20) == 1024 - 20 - 256
    lim = limits_from(
        None,
        header_bytes=16384,
        max_headers=100,
        request_timeout=10,
        keep_alive=5,
        soft_limit=1024,
        in_use=20,
        error=ValueError,
    )
    assert lim.max_connections == 748
    assert lim.uvicorn_settings()["limit_concurrency"] > lim.max_connections
    with pytest.raises(ValueError, match="--max-connections 800: over"):
        limits_from(
            800,
            header_bytes=16384,
            max_headers=100,
            request_timeout=10,
            keep_alive=5,
            soft_limit=1024,
            in_use=20,
            error=ValueError,
        )
    with pytest.raises(ValueError, match="raise `ulimit -n`"):
        limits_from(
            None,
            header_bytes=16384,
            max_headers=100,
            request_timeout=10,
            keep_alive=5,
            soft_limit=256,
            in_use=20,
            error=ValueError,
        )


def _reply(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 2 s pass)."""
    s.settimeout(2)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


class Responses:
    """Responses read one at a time from a kept-alive connection (several may arrive in one
    read when requests are pipelined; this app's responses carry a content-length)."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buf = b""
        s.settimeout(5)

    def next(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.s.recv(65536)
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        fields = [h.split(b":", 1) for h in head.split(b"\r\n")[1:]]
        length = int(next(v for k, v in fields if k.strip().lower() == b"content-length"))
        while len(rest) < length:
            rest += self.s.recv(65536)
        self.buf = rest[length:]
        return head + b"\r\n\r\n" + rest[:length]


def test_guarded_protocol_is_uvicorns_httptools_one_when_httptools_is_installed():
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(guarded_protocol(ConnectionGuard(Limits())), HttpToolsProtocol)


def test_a_head_that_does_not_come_in_time_closes_the_connection(protocol):
    with _running(Limits(max_connections=4, request_timeout=0.3), protocol) as server:
        s = server.connect()
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # never completed
        t0 = time.monotonic()
        assert _closed(s)
        assert 0.2 < time.monotonic() - t0 < 2
        assert server.guard.closed["request_timeout"] == 1
        s.close()


def test_a_head_over_the_size_cap_sent_in_pieces_is_refused_with_400(protocol):
    with _running(Limits(max_connections=4, header_bytes=4096), protocol) as server:
        s = server.connect()
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n")
        for i in range(20):  # 20 pieces of ~1 KB, the head never complete
            try:
                s.sendall(b"x-pad-%d: %s\r\n" % (i, b"y" * 1000))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.01)
        reply = _reply(s)
        assert reply.startswith(b"HTTP/1.1 400"), reply
        assert server.guard.closed["bad_request"] == 1
        s.close()


def test_heads_under_the_cap_are_answered_on_one_connection_whatever_they_add_up_to(protocol):
    # The cap is per head: the bytes of earlier requests on a kept-alive connection do not count.
    with _running(Limits(max_connections=4, header_bytes=4096), protocol) as server:
        s = server.connect()
        responses = Responses(s)
        for _ in range(10):  # 10 heads of ~3 KB: 30 KB in all, each under 4 KiB, each in two
            # pieces, so that the first is counted while the head is incomplete
            s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\nx-pad: %s" % (b"y" * 3000))
            time.sleep(0.02)
            s.sendall(b"\r\n\r\n")
            assert responses.next().startswith(b"HTTP/1.1 200")
        assert server.guard.closed == dict.fromkeys(server.guard.closed, 0)
        s.close()


def test_a_body_is_not_counted_as_head(protocol):
    with _running(Limits(max_connections=4, header_bytes=4096), protocol) as server:
        s = server.connect()
        body = b"z" * 20000
        s.sendall(
            b"POST /fast HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        reply = Responses(s).next()
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"got 20000"), reply
        assert server.guard.closed["bad_request"] == 0
        s.close()


def test_pipelined_requests_are_each_answered(protocol):
    with _running(Limits(max_connections=4, header_bytes=4096), protocol) as server:
        s = server.connect()
        s.sendall((GET % b"a") + (GET % b"b") + (GET % b"c"))
        responses = Responses(s)
        for _ in range(3):
            assert responses.next().startswith(b"HTTP/1.1 200")
        assert server.guard.closed == dict.fromkeys(server.guard.closed, 0)
        assert not _closed(s)  # kept alive, waiting for the next head
        s.close()


def test_too_many_header_fields_get_431_alone_and_nothing_after_it(protocol):
    with _running(Limits(max_connections=4, max_headers=5), protocol) as server:
        s = server.connect()
        fields = b"".join(b"x-h%d: v\r\n" % i for i in range(10))
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n" + (GET % b"next"))
        reply = _reply(s)
        assert reply.startswith(b"HTTP/1.1 431"), reply
        assert reply.count(b"HTTP/1.1") == 1, reply  # the pipelined request is not answered
        assert server.guard.closed["too_many_headers"] == 1
        assert server.guard.closed["bad_request"] == 0
        s.close()


def test_a_crowd_of_connections_gone_is_said_once(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`connections_gone` (what has the directory scan give the freed heap back): True once
    enough connections have closed since the most held at once and at most half of that
    peak is still open; then not again until a new crowd comes and goes."""
    monkeypatch.setattr(connections, "RELEASE_AFTER_CLOSED", 3)
    guard = server.guard
    socks = [server.connect() for _ in range(4)]  # the cap is 4: none evicted
    wait_until(lambda: guard.open == 4, 5, "4 connections held")
    assert guard.peak == 4 and not guard.connections_gone()
    for s in socks[:2]:
        s.close()
    wait_until(lambda: guard.open == 2, 5, "2 closed")
    assert not guard.connections_gone()  # 2 closed since the peak: fewer than 3
    socks[2].close()
    wait_until(lambda: guard.open == 1, 5, "3 closed")
    assert guard.connections_gone()
    assert not guard.connections_gone()  # said once: the peak is now what is open
    assert guard.peak == 1
    socks[3].close()
