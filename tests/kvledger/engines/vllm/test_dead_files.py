"""A file whose process was killed without closing (vLLM's default shutdown SIGKILLs its
engine core and workers) is listed down, then removed once forgotten: it never stays
forever. A live but silent publisher's file is only forgotten, never removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from accounting.snapfile.format import parse
from accounting.snapfile.writer import Publisher
from exporter.sources import Sources
from tests.ledgers import small_ledger


def test_a_killed_publishers_file_is_removed_once_forgotten(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    labels = {"model_name": "m", "engine_type": "vllm_scheduler"}
    with small_ledger(labels) as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        envelope, rows = parse(Path(pub.path).read_bytes())
    dead = tmp_path / "dead.json"
    dead.write_bytes(
        json.dumps({**envelope, "source": "dead", "pid": child.pid}).encode() + b"\n" + rows
    )
    now = [envelope["published_at"] + 1]
    src = Sources(tmp_path, forget_after=30, clock=lambda: now[0])
    [v] = src.read().views
    assert not v.up and f"pid {child.pid} has exited" in (v.stale_reason or "")
    assert dead.exists() and src.removed == 0  # down (its alert fires) until forgotten
    now[0] = envelope["published_at"] + 31
    assert src.read().views == ()
    assert not dead.exists() and src.removed == 1


def test_a_silent_live_publishers_file_is_only_forgotten(tmp_path: Path) -> None:
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        envelope, _ = parse(Path(pub.path).read_bytes())
        now = [envelope["published_at"] + 61]
        src = Sources(tmp_path, stale_after=5, forget_after=60, clock=lambda: now[0])
        assert src.read().views == ()
        assert os.path.exists(pub.path) and src.removed == 0  # its pid (this one) lives
