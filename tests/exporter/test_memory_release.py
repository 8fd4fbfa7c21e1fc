"""Issue 43 finding 7: what 1,000 sources cost while they are served is released once they
are gone. Measured with tracemalloc (Python objects still alive, not RSS, which the
allocator's reuse makes noisy) in a real uvicorn server in this process, scraped over
HTTP: /metrics in both formats, gzipped, and /debug/kv."""

from __future__ import annotations

import gc
import json
import os
import tracemalloc
from pathlib import Path

import httpx

from accounting.ledger import Ledger
from accounting.snapfile.format import parse
from accounting.snapfile.writer import Publisher
from exporter.app import create_app
from exporter.sources import Sources
from tests.servers import UvicornThread

SOURCES = 1000
OPENMETRICS = "application/openmetrics-text;version=1.0.0"


def test_objects_of_1000_departed_sources_are_released(tmp_path):
    d = tmp_path / "snap"
    with (
        Sources(d, create=True) as sources,
        Publisher(Ledger({"model_name": "kept", "tp_rank": "0"}), d, interval=3600) as pub,
        UvicornThread(create_app(sources)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):

        def scrape() -> str:
            for headers in ({}, {"Accept": OPENMETRICS, "Accept-Encoding": "gzip"}):
                assert client.get("/metrics", headers=headers).status_code == 200
            assert client.get("/debug/kv").status_code == 200
            return client.get("/metrics").text

        for _ in range(5):
            scrape()
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            envelope, rows = parse(Path(pub.path).read_bytes())
            for i in range(SOURCES):
                snap = {**envelope["snapshot"], "labels": {"model_name": f"m{i}", "tp_rank": "0"}}
                e = {**envelope, "source": f"s{i}", "snapshot": snap}
                (d / f"s{i}.json").write_bytes(json.dumps(e).encode() + b"\n" + rows)
            for _ in range(SOURCES // 64 + 2):  # a scan parses at most 64 new files
                text = client.get("/metrics").text
            assert text.count("kvledger_up{") == SOURCES + 1
            scrape()
            peak = tracemalloc.get_traced_memory()[0]
            for i in range(SOURCES):
                os.unlink(d / f"s{i}.json")
            for _ in range(3):
                text = scrape()
            assert text.count("kvledger_up{") == 1
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    # tracemalloc counts what was allocated since it started and is still alive
    print(f"traced: {base} B at the start, {peak} B with {SOURCES} sources, {after} B after")
    assert peak - base > 5 << 20, (base, peak)  # they did cost something
    # Before, the label sets of the departed sources stayed memoised (~5 MB of strings and
    # tuples, up to 65,536 label sets) and kept the heap from shrinking.
    assert after - base < 1 << 20, (base, peak, after)


def test_a_crowd_of_connections_gone_has_the_scan_give_the_heap_back(tmp_path, monkeypatch):
    """The server's guard says when a crowd of client connections has gone
    (`Sources.connections_gone`, set by `kvledger serve`); the scan then gives the freed
    heap back (`release_free_memory`) at that read and the next, and not at reads after."""
    import exporter.sources as sources_mod

    trims: list[int] = []

    def release() -> bool:
        trims.append(1)
        return True

    monkeypatch.setattr(sources_mod, "release_free_memory", release)
    gone = [False]
    with Sources(tmp_path / "snap", create=True) as sources:
        sources.connections_gone = lambda: gone[0]
        sources.read()
        assert trims == []
        gone[0] = True
        sources.read()
        gone[0] = False
        sources.read()
        sources.read()
    assert trims == [1, 1]
