"""`kvledger.bench.scrape_tail`: a republished scrape watched from inside the server (the scan
thread's time, the collector's), each variant a server of its own (no timing asserted)."""

from __future__ import annotations

import io
import os
import tempfile

import pytest

from kvledger.bench import scrape_tail

pytestmark = pytest.mark.slow


def test_a_bad_variant_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        scrape_tail.main(["--variants", "default,gc_off"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'default,gc_off': expected distinct names of default,gc-off,h11,inline,pinned" in err
    assert len(err.strip().splitlines()) == 1


def test_each_variant_is_watched_from_inside_its_server(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the tool's directories go here
    args = scrape_tail.parser().parse_args(["--ranks", "2", "--scrapes", "12", "--rounds", "2"])
    out = io.StringIO()
    got = scrape_tail.run(args, out)
    assert {v: len(runs) for v, runs in got.items()} == dict.fromkeys(scrape_tail.VARIANTS, 2)
    for runs in got.values():
        for r in runs:
            # every measured GET had its own scan (no background scan: --scan-interval 0)
            assert r["scans"] == 12
            assert 0 < r["scan_cpu_p50"] <= r["scan_cpu_p99"]
            assert 0 < r["scan_wall_p50"] <= r["get_p50"]
    assert all(r["gc_collections"] == 0 and r["gc_ms"] == 0 for r in got["gc-off"])
    # inline: every scan on the event loop's thread (uvicorn's: the main one); else none
    assert all(r["scans_on_main_thread"] == 12 for r in got["inline"])
    assert all(r["scans_on_main_thread"] == 0 for r in got["default"])
    assert all(r["scan_cpus_max"] == 1 for r in got["pinned"])
    text = out.getvalue()
    for v in scrape_tail.VARIANTS:
        assert f"round 1 {v}: get_p50 " in text and f"  {v}: get_p50 " in text
    # the private directory (its sitecustomize, the events files) and the rank files are gone
    assert os.listdir(tmp_path) == []
