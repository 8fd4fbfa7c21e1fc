"""Keep-alive HTTP clients for `kvledger bench scrape --clients N`, in a process of their own.

    python -m kvledger.tools.bench.loadgen --port PORT --clients 200 --seconds 30 [--interval S]

N asyncio connections, each sending `GET /metrics` (Prometheus' Accept and
Accept-Encoding: gzip) and reading the whole response before the next request, on
one keep-alive connection each: back to back, or one request every `--interval`
seconds per client (as a scraper does; starts spread over the first interval). Prints one JSON object: request
count, errors (by kind), and per-request latencies in milliseconds. Standard
library only, so the process starts fast and measures nothing of kvledger's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def request_bytes(host: str, port: int, path: str) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: {ACCEPT}\r\n"
        "Accept-Encoding: gzip\r\nUser-Agent: kvledger-bench\r\n\r\n"
    ).encode()


async def _response(reader: asyncio.StreamReader) -> int:
    """Read one response whole; return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(
        (
            int(v)
            for k, _, v in (ln.partition(":") for ln in lines[1:])
            if k.lower() == "content-length"
        ),
        None,
    )
    if length is None:
        raise ValueError("response without Content-Length")
    await reader.readexactly(length)
    return status


async def _client(
    host: str,
    port: int,
    req: bytes,
    deadline: float,
    lat: list[float],
    errors: dict[str, int],
    interval: float,
    offset: float,
) -> None:
    await asyncio.sleep(offset)
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            errors[f"connect: {e.strerror}"] = errors.get(f"connect: {e.strerror}", 0) + 1
            await asyncio.sleep(0.05)
            continue
        try:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                writer.write(req)
                status = await asyncio.wait_for(_response(reader), 30)
                took = time.perf_counter() - t0
                lat.append(took * 1000)
                if status != 200:
                    errors[f"HTTP {status}"] = errors.get(f"HTTP {status}", 0) + 1
                if interval > 0:
                    await asyncio.sleep(max(0.0, interval - took))
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            kind = type(e).__name__
            errors[kind] = errors.get(kind, 0) + 1
        finally:
            writer.close()


async def run_clients(
    host: str,
    port: int,
    clients: int,
    seconds: float,
    path: str = "/metrics",
    interval: float = 0.0,
) -> dict[str, Any]:
    lat: list[float] = []
    errors: dict[str, int] = {}
    req = request_bytes(host, port, path)
    deadline = time.monotonic() + seconds
    await asyncio.gather(
        *(
            _client(host, port, req, deadline, lat, errors, interval, interval * i / clients)
            for i in range(clients)
        )
    )
    return {
        "clients": clients,
        "seconds": seconds,
        "interval": interval,
        "requests": len(lat),
        "errors": errors,
        "latencies_ms": lat,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m kvledger.tools.bench.loadgen")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument(
        "--interval", type=float, default=0.0, help="seconds between a client's requests"
    )
    args = p.parse_args()
    result = run_clients(args.host, args.port, args.clients, args.seconds, interval=args.interval)
    print(json.dumps(asyncio.run(result)))


if __name__ == "__main__":
    main()
