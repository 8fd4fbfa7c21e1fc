"""exporter.connections on a real uvicorn server (loopback): the connection cap makes room
by closing the connection that waited longest without a request, refuses a new one with
503 when every held one is being answered (never serving it late), and the limits'
arguments are checked."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from exporter.connections import ConnectionGuard, Limits, fd_budget, guarded_protocol, limits_from
from tests.servers import wait_until


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
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Server:
    def __init__(self, limits: Limits) -> None:
        self.app = SlowApp()
        self.guard = ConnectionGuard(limits)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        config = uvicorn.Config(
            self.app,
            log_level="error",
            lifespan="off",
            http=guarded_protocol(self.guard),
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


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(Limits(max_connections=4, request_timeout=30))
    srv.thread.start()
    wait_until(lambda: srv.server.started, 10, "uvicorn started")
    try:
        yield srv
    finally:
        srv.app.release.set()
        srv.server.should_exit = True
        srv.thread.join(10)
        srv.sock.close()


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
