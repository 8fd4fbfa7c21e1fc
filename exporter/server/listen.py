"""The listening socket of `kvledger serve`: bound before the URL is printed, TCP_NODELAY
for every connection, and the rule that a non-loopback bind needs a token.

Accepted connections get TCP_NODELAY: a keep-alive client's second request would
otherwise wait for the delayed ACK of the first response (~40 ms on Linux), and
Prometheus keeps its connections alive. The socket is created with the protocol
getaddrinfo gives (IPPROTO_TCP), so asyncio sets TCP_NODELAY on each accepted
socket, and the option is set on the listening socket too (Linux copies it to
accepted ones).
"""

from __future__ import annotations

import ipaddress
import socket

from exporter.server.errors import UsageError


def is_loopback(sockaddr: tuple[object, ...]) -> bool:
    try:
        return ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int, *, token: bool, insecure_no_token: bool) -> socket.socket:
    """A listening TCP socket on (host, port); UsageError (one line) when the address does
    not resolve or bind, or when it is not loopback and there is no token and no
    `insecure_no_token`."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: expected 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    if not token and not insecure_no_token and not is_loopback(addr):
        raise UsageError(
            f"--host {host} ({addr[0]}) is reachable from other machines and /debug/* would be "
            "open: give a token (--token-file FILE or $KVLEDGER_TOKEN) or basic_auth_users "
            "in --web.config.file, or pass --insecure-no-token if that is intended"
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(addr)
        # Listening from here on: a client that connects as soon as the URL is printed waits
        # in the backlog until uvicorn accepts, instead of being refused.
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot bind: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock
