"""Floods of hostile local clients for the tests of `kvledger serve` (issue 43), each on
loopback, bounded in count and time, run in a thread of the test process, and a probe that
measures what a well-behaved client gets meanwhile.

- `SlowReaders`: connections with a 2 KiB receive buffer, each sending many pipelined
  requests at once and never reading the answers; reopened when the server closes them.
- `SilentTLS`: TCP connections to a TLS port that never send a ClientHello (or drip one
  byte of one now and then); reopened when the server closes them.
- `WrongPasswords`: connections sending basic auth with a new wrong password each time.
- `probe`: requests from a well-behaved client for a while; their statuses and latencies.
"""

from __future__ import annotations

import base64
import contextlib
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_ESTABLISHED = 1  # tcp_info.tcpi_state


def _established(s: socket.socket) -> bool:
    """Whether the connection is still open at the kernel (the server has neither reset
    nor half-closed it), without reading from it."""
    try:
        state = struct.unpack("B", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]
    except OSError:
        return False
    return bool(state == _ESTABLISHED)


class _Flood:
    """`n` attacking connections, opened in batches, each checked every `check` s and
    reopened once the server closed it (after `reopen` s). Subclasses say how to open one
    (`_open`) and what to do with it afterwards (`_tick`)."""

    def __init__(
        self, addr: tuple[str, int], n: int, *, reopen: float = 0.5, check: float = 0.2
    ) -> None:
        self.addr = addr
        self.n = n
        self.reopen = reopen
        self.check = check
        self.socks: list[socket.socket] = []
        self.opened = 0
        self.closed = 0
        self.connect_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket | None:
        raise NotImplementedError

    def _tick(self, s: socket.socket, now: float) -> None:
        pass

    def _open_one(self) -> None:
        try:
            s = self._open()
        except OSError:
            self.connect_failures += 1
            return
        if s is not None:
            self.socks.append(s)
            self.opened += 1

    def _run(self) -> None:
        for i in range(self.n):
            if self._stop.is_set():
                return
            self._open_one()
            if i % 25 == 24:
                time.sleep(0.02)  # the kernel's accept queue is 64
        next_reopen = time.monotonic() + self.reopen
        while not self._stop.wait(self.check):
            now = time.monotonic()
            alive = []
            for s in self.socks:
                if _established(s):
                    self._tick(s, now)
                    alive.append(s)
                else:
                    self.closed += 1
                    s.close()
            self.socks = alive
            if now >= next_reopen:
                next_reopen = now + self.reopen
                for _ in range(self.n - len(self.socks)):
                    self._open_one()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        self.socks = []


class SlowReaders(_Flood):
    """Each connection: receive buffer 2 KiB, `pipelined` requests for `path` sent at once,
    nothing ever read."""

    def __init__(
        self, addr: tuple[str, int], n: int, *, path: str = "/metrics", pipelined: int = 64
    ) -> None:
        super().__init__(addr, n)
        self.requests = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * pipelined

    def _open(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: the window
        s.settimeout(2)
        try:
            s.connect(self.addr)
            s.sendall(self.requests)
        except OSError:
            s.close()
            raise
        return s


class SilentTLS(_Flood):
    """Each connection: TCP only, no ClientHello; with `drip` seconds, one byte of a TLS
    record header every `drip` seconds (a handshake that never completes)."""

    HELLO = b"\x16\x03\x01\x02\x00" + b"\x01" * 512

    def __init__(self, addr: tuple[str, int], n: int, *, drip: float | None = None) -> None:
        super().__init__(addr, n)
        self.drip = drip
        self._sent: dict[int, tuple[int, float]] = {}

    def _open(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=2)
        self._sent[s.fileno()] = (0, time.monotonic())
        return s

    def _tick(self, s: socket.socket, now: float) -> None:
        if self.drip is None:
            return
        sent, last = self._sent.get(s.fileno(), (0, now))
        if now - last >= self.drip and sent < len(self.HELLO):
            with contextlib.suppress(OSError):
                s.send(self.HELLO[sent : sent + 1])
                self._sent[s.fileno()] = (sent + 1, now)


def read_some(s: socket.socket) -> bytes | None:
    """What a ready socket has (b"" once it is closed or broken), None if it has nothing yet."""
    try:
        return s.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


@dataclass
class Probed:
    """What a well-behaved client got: (path, status or error name, seconds) per request."""

    results: list[tuple[str, str, float]] = field(default_factory=list)

    @property
    def failures(self) -> list[tuple[str, str, float]]:
        return [r for r in self.results if r[1] != "200"]

    def p99(self) -> float:
        times = sorted(t for _, _, t in self.results)
        return times[min(len(times) - 1, int(len(times) * 0.99))]

    def worst(self) -> float:
        return max(t for _, _, t in self.results)

    def summary(self) -> str:
        return (
            f"{len(self.results)} requests, {len(self.failures)} failed "
            f"({self.failures[:3]}), p99 {self.p99() * 1000:.1f} ms, "
            f"worst {self.worst() * 1000:.1f} ms"
        )


def raw_get(
    addr: tuple[str, int],
    tls: ssl.SSLContext | None = None,
    auth: str | None = None,
    source: str | None = None,
) -> Callable[[str], int]:
    """A GET over a new connection each time (a plain socket, wrapped in TLS with `tls`;
    basic auth `auth` = "user:password"; from the local address `source`, a loopback one
    such as 127.0.0.2, when given), read to its content-length; returns the status.
    No HTTP library: what is timed is the server."""
    bind = (source, 0) if source is not None else None
    extra = b""
    if auth is not None:
        extra = b"Authorization: Basic " + base64.b64encode(auth.encode()) + b"\r\n"

    def get(path: str) -> int:
        with socket.create_connection(addr, timeout=5, source_address=bind) as raw:
            s = tls.wrap_socket(raw, server_hostname=addr[0]) if tls is not None else raw
            s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path.encode(), extra))
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise httpx.RemoteProtocolError(f"closed after {buf[:80]!r}")
                buf += chunk
            head, _, body = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            while len(body) < length:
                chunk = s.recv(65536)
                if not chunk:
                    raise httpx.RemoteProtocolError("closed mid-body")
                body += chunk
            return int(head.split(b" ", 2)[1])

    return get


def probe(
    get: Callable[[str], httpx.Response | int],
    seconds: float,
    paths: tuple[str, ...] = ("/healthz", "/metrics"),
    pause: float = 0.05,
) -> Probed:
    """`get(path)` for each of `paths` in turn for `seconds`, `pause` s apart."""
    out = Probed()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in paths:
            t0 = time.perf_counter()
            try:
                r = get(path)
                status = str(r if isinstance(r, int) else r.status_code)
            except (httpx.HTTPError, OSError) as e:
                status = type(e).__name__
            out.results.append((path, status, time.perf_counter() - t0))
        time.sleep(pause)
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class WrongPasswords:
    """`n` connections each sending GET `path` with basic auth for `user` and a password
    never sent before, the next as soon as an answer is in (kept alive), reconnecting
    when the server closes the connection. Counts the answers by status."""

    def __init__(
        self,
        addr: tuple[str, int],
        n: int,
        user: str,
        path: str = "/metrics",
        source: str | None = None,
    ) -> None:
        self.addr, self.n, self.user, self.path = addr, n, user, path
        self.source = (source, 0) if source is not None else None  # local address
        self.statuses: dict[str, int] = {}
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _request(self) -> bytes:
        self.sent += 1
        tag = f"{self.source[0]}-" if self.source is not None else ""  # new across floods
        auth = base64.b64encode(f"{self.user}:wrong-{tag}{self.sent}".encode())
        return b"GET %s HTTP/1.1\r\nHost: x\r\nAuthorization: Basic %s\r\n\r\n" % (
            self.path.encode(),
            auth,
        )

    def _open(self, sel: selectors.BaseSelector) -> None:
        try:
            s = socket.create_connection(self.addr, timeout=2, source_address=self.source)
            s.sendall(self._request())
        except OSError:
            self.statuses["connect_failed"] = self.statuses.get("connect_failed", 0) + 1
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, [b""])

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for _ in range(self.n):
            self._open(sel)
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                s = key.fileobj
                data = read_some(s)  # type: ignore[arg-type]
                if data is None:
                    continue
                buf = key.data[0] + data
                if not data:
                    sel.unregister(s)
                    s.close()  # type: ignore[union-attr]
                    if not self._stop.is_set():
                        self._open(sel)
                    continue
                head, sep, body = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                if not sep or len(body) < length:
                    key.data[0] = buf
                    continue
                status = head.split(b" ", 2)[1].decode()
                self.statuses[status] = self.statuses.get(status, 0) + 1
                key.data[0] = body[length:]
                with contextlib.suppress(OSError):
                    s.send(self._request())  # type: ignore[union-attr]
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()

    def __enter__(self) -> WrongPasswords:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
