"""`kvledger serve` after 5,000 snapshot files came and went: what they cost is given back,
not kept at the peak (bounded caches, freed heap returned to the OS)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from accounting.ledger import Ledger
from accounting.snapfile.format import parse
from accounting.snapfile.writer import Publisher
from tests.servers import ServeProcess, wait_until

pytestmark = pytest.mark.slow


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_of_5000_files_is_given_back_once_they_are_gone(tmp_path):
    d = tmp_path / "snap"
    server = ServeProcess(["--port", "0", "--no-demo", "--snapshot-dir", str(d)])
    publisher = Publisher(Ledger({"model_name": "good", "tp_rank": "0"}), d, interval=0.5)
    try:
        url = server.url

        def scrape() -> None:
            assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
            assert httpx.get(f"{url}/debug/kv", timeout=30).status_code == 200

        wait_until(lambda: 'model_name="good"' in httpx.get(f"{url}/metrics").text, 20, "up")
        for _ in range(5):
            scrape()
        base = _rss_mib(server.proc.pid)
        envelope, rows = parse(Path(publisher.path).read_bytes())
        for i in range(5000):
            snap = {**envelope["snapshot"], "labels": {"model_name": f"m{i}", "tp_rank": "0"}}
            e = {**envelope, "source": f"f{i}", "snapshot": snap}
            (d / f"f{i}.json").write_bytes(json.dumps(e).encode() + b"\n" + rows)
        deadline = time.monotonic() + 20  # the scan reads 1,024 of them, 64 new a scan
        while time.monotonic() < deadline:
            scrape()
            time.sleep(0.3)
        peak = _rss_mib(server.proc.pid)
        for i in range(5000):
            os.unlink(d / f"f{i}.json")
        for _ in range(10):
            scrape()
            time.sleep(0.3)
        after = _rss_mib(server.proc.pid)
        assert peak - base > 5, (base, peak)  # they did cost something
        assert peak - after >= 3, (base, peak, after)  # and some of it came back
        assert after - base < 32, (base, peak, after)
    finally:
        publisher.close()
        assert server.close() == 0
