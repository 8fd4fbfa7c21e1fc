"""`exporter.serving`: which encoding a client accepts, and which `/metrics` bodies a scan
builds ahead (`MetricsBodies`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exporter.serving import WANTED_S, MetricsBodies, accepts_gzip
from exporter.sources import Scan

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


class _Collector:
    def __init__(self) -> None:
        self.renders: list[str | None] = []

    def render(self, accept: str | None, scan: Any) -> tuple[bytes, str]:
        self.renders.append(accept)
        return b"body", "text/plain"


def test_a_body_asked_for_once_is_built_ahead_only_while_it_is_asked_for() -> None:
    """A scraper's format is built with every scan; a format fetched once by hand is built
    with the scans of the next WANTED_S seconds only, then when asked (it was built with
    every scan forever, doubling what each scan of a scraped exporter cost)."""
    now = [1000.0]
    collector = _Collector()
    bodies = MetricsBodies(collector, clock=lambda: now[0])  # type: ignore[arg-type]

    async def ask(generation: int, accept: str | None, gz: bool = False) -> None:
        await bodies.get(generation, Scan(), accept, gz)

    asyncio.run(ask(1, OPENMETRICS))
    asyncio.run(ask(1, None, gz=True))  # by hand, once: text format, gzip
    assert sorted(bodies.wanted) == [(False, True), (True, False)]
    assert len(bodies.prepare(Scan())) == 2

    now[0] += WANTED_S / 2
    asyncio.run(ask(2, OPENMETRICS))  # the scraper keeps asking
    now[0] += WANTED_S / 2 + 1
    collector.renders.clear()
    prepared = bodies.prepare(Scan())
    assert list(prepared) == [(True, False)]
    assert collector.renders == [OPENMETRICS]
    assert bodies.wanted == [(True, False)]

    asyncio.run(ask(3, None, gz=True))  # asked again: built for it, and wanted again
    assert sorted(bodies.wanted) == [(False, True), (True, False)]


def test_a_format_wanted_plain_and_gzipped_is_rendered_once_per_scan() -> None:
    """Two scrapers of one format, one asking for gzip (as Prometheus does) and one not: a
    scan renders that format once and compresses the same body."""
    import gzip

    collector = _Collector()
    bodies = MetricsBodies(collector)  # type: ignore[arg-type]

    async def ask(accept: str | None, gz: bool) -> None:
        await bodies.get(1, Scan(), accept, gz)

    asyncio.run(ask(OPENMETRICS, True))
    asyncio.run(ask(OPENMETRICS, False))
    asyncio.run(ask(None, True))  # the other format: a render of its own
    collector.renders.clear()
    prepared = bodies.prepare(Scan())
    assert sorted(prepared) == [(False, True), (True, False), (True, True)]
    assert sorted(collector.renders, key=str) == sorted([OPENMETRICS, None], key=str)
    assert gzip.decompress(prepared[(True, True)][0]) == prepared[(True, False)][0] == b"body"
    assert gzip.decompress(prepared[(False, True)][0]) == b"body"


@pytest.mark.parametrize(
    ("header", "gzip"),
    [
        ("gzip", True),
        ("x-gzip", True),
        ("GZip;q=0.5, deflate", True),
        ("identity, gzip;q=1", True),
        ("gzip;q=0", False),  # RFC 9110: q=0 is "not acceptable"
        ("gzip;q=0.0", False),
        ("gzip;q=0.000, identity", False),
        ("gzip;q=nonsense", False),
        ("deflate, br", False),
        ("", False),
        (None, False),
    ],
)
def test_accepts_gzip_only_where_the_client_takes_it(header: str | None, gzip: bool) -> None:
    assert accepts_gzip(header) is gzip
