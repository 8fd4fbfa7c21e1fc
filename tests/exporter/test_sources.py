from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from accounting.publisher import Publisher, parse
from exporter.sources import Sources
from tests.ledgers import small_ledger


def test_reads_published_files_and_caches_by_file_identity(tmp_path):
    with small_ledger({"model_name": "m", "tp_rank": "0"}) as sl:
        with Publisher(sl.ledger, tmp_path, interval=1000) as pub:
            pub.publish()
            src = Sources(tmp_path)
            [v] = src.read()
            assert v.up and v.source == pub.source
            assert v.snapshot.epoch == sl.ledger.epoch
            assert src.parses == 1
            src.read()
            src.read()
            assert src.parses == 1  # unchanged file: no parse
            sl.allocate(10)
            pub.publish()
            [v] = src.read()
            assert src.parses == 2
            assert v.summary["totals"]["occupied_slots"] == 10
            assert v.snapshot.rollup("family")[("swa_kv",)]["occupied_slots"] == 10
        assert src.read() == []  # closed publisher: its file and its source are gone


def test_in_process_ledger_is_read_live(tmp_path):
    with small_ledger() as sl:
        src = Sources()
        name = src.add_ledger(sl.ledger)
        sl.allocate(5)
        [v] = src.read()
        assert v.source == name and v.up and v.published.interval == 0
        assert v.snapshot.epoch == sl.ledger.epoch
        src.remove_ledger(name)
        assert src.read() == []


def test_old_heartbeat_marks_stale_with_reason(tmp_path):
    now = [1000.0]
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        d, _ = parse(Path(pub.path).read_bytes())
        src = Sources(tmp_path, stale_after=5, clock=lambda: now[0])
        now[0] = d["published_at"] + 4
        [v] = src.read()
        assert v.up
        now[0] = d["published_at"] + 6
        [v] = src.read()
        assert not v.up
        assert "heartbeat" in v.stale_reason and "5.0 s" in v.stale_reason
        assert v.age_seconds >= 6


def test_stale_sources_are_forgotten_after_the_bound(tmp_path):
    now = [0.0]
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        d, _ = parse(Path(pub.path).read_bytes())
        src = Sources(tmp_path, stale_after=5, forget_after=60, clock=lambda: now[0])
        now[0] = d["published_at"] + 30
        [v] = src.read()
        assert not v.up
        now[0] = d["published_at"] + 61
        assert src.read() == []
        assert os.path.exists(pub.path)  # forgotten, not deleted


def test_dead_pid_marks_stale_at_once(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        d, rows = parse(Path(pub.path).read_bytes())
        d["pid"] = child.pid
        d["source"] = "dead"
        (tmp_path / "dead.json").write_bytes(json.dumps(d).encode() + b"\n" + rows)
        views = {v.source: v for v in Sources(tmp_path).read()}
        assert views[pub.source].up
        assert not views["dead"].up
        assert f"pid {child.pid}" in views["dead"].stale_reason


def test_reused_pid_marks_stale(tmp_path):
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        d, rows = parse(Path(pub.path).read_bytes())
        d["process_start"] -= 1  # same pid, another process
        d["source"] = "reused"
        (tmp_path / "reused.json").write_bytes(json.dumps(d).encode() + b"\n" + rows)
        views = {v.source: v for v in Sources(tmp_path).read()}
        assert "another process" in views["reused"].stale_reason


def test_foreign_and_temporary_files_are_skipped(tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / ".x.tmp").write_text("partial")
    (tmp_path / "notes.txt").write_text("hi")
    src = Sources(tmp_path)
    assert src.read() == []
    assert set(src.unreadable) == {str(tmp_path / "junk.json"), str(tmp_path / "other.json")}
    os.unlink(tmp_path / "junk.json")
    src.read()
    assert set(src.unreadable) == {str(tmp_path / "other.json")}


def test_missing_directory_reads_empty(tmp_path):
    assert Sources(tmp_path / "nope").read() == []
