"""Temporary files of publishers killed mid-write: removed after a grace period by the
exporter (a live `kvledger serve`) and by the next publisher of that name; nothing that is
not ours by name, owner and type is touched, and no link is followed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from accounting.ledger import Ledger
from accounting.snapfile.writer import Publisher
from tests.hostile import nobody_uid
from tests.servers import ServeProcess, repo_env, stop, wait_until

pytestmark = pytest.mark.slow


def _killed_mid_write(directory: Path, source: str) -> str:
    """A publisher of `source` killed between writing its temporary file and renaming it;
    returns the temporary file's name."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.kvledger.stuck_publisher", str(directory), source],
        stdout=subprocess.PIPE,
        env=repo_env(),
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("stuck "), line
        proc.kill()
        proc.wait()
    finally:
        stop(proc)
    tmp = line.split()[1]
    assert (directory / tmp).stat().st_size > 0
    return tmp


def _old(path: Path, age: float = 3600) -> None:
    t = time.time() - age
    os.utime(path, (t, t), follow_symlinks=False)


def _not_ours(directory: Path, canary: Path) -> list[str]:
    """Entries that look like leftovers by name but are not ours to remove, all old."""
    names = []
    link = directory / ".link.json.0123456789abcdef.tmp"
    os.symlink(canary, link)
    fifo = directory / ".fifo.json.0123456789abcdef.tmp"
    os.mkfifo(fifo)
    sub = directory / ".dir.json.0123456789abcdef.tmp"
    sub.mkdir()
    other_name = directory / ".x.json.0123.tmp"  # not the pattern
    other_name.write_bytes(b"x")
    plain = directory / "notes.tmp"
    plain.write_bytes(b"x")
    names += [link.name, fifo.name, sub.name, other_name.name, plain.name]
    uid = nobody_uid()
    if uid is not None:
        foreign = directory / ".foreign.json.0123456789abcdef.tmp"
        foreign.write_bytes(b"x")
        os.chown(foreign, uid, -1)
        names.append(foreign.name)
    for n in names:
        _old(directory / n)
    return names


def test_the_exporter_removes_dead_publishers_temporaries_after_the_grace(tmp_path):
    directory = tmp_path / "snap"
    canary = tmp_path / "canary"
    canary.write_bytes(b"keep")
    server = ServeProcess(
        ["--port", "0", "--no-demo", "--snapshot-dir", str(directory), "--temp-grace", "2"]
    )
    try:
        tmps = [_killed_mid_write(directory, f"dead{i}") for i in range(3)]
        keep = _not_ours(directory, canary)
        t0 = time.monotonic()
        assert all((directory / t).exists() for t in tmps)
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        wait_until(
            lambda: not any((directory / t).exists() for t in tmps),
            15,
            "the dead publishers' temporary files removed",
        )
        assert time.monotonic() - t0 >= 1.0  # not before the grace
        left = set(os.listdir(directory))
        assert set(keep) <= left, (keep, left)
        assert canary.read_bytes() == b"keep"
        # A temporary file being written (young) is left alone.
        young = directory / ".live.json.fedcba9876543210.tmp"
        young.write_bytes(b"{")
        time.sleep(1.5)
        assert young.exists()
    finally:
        assert server.close() == 0


def test_the_next_publisher_of_that_name_removes_its_predecessors_temporary(tmp_path):
    directory = tmp_path / "snap"
    directory.mkdir(mode=0o700)
    canary = tmp_path / "canary"
    canary.write_bytes(b"keep")
    mine = _killed_mid_write(directory, "engine")
    theirs = _killed_mid_write(directory, "other")
    keep = _not_ours(directory, canary)
    for n in (mine, theirs):
        _old(directory / n, 120)
    with Publisher(Ledger({"tp_rank": "0"}), directory, source="engine", interval=3600) as p:
        assert p.temporaries_removed == 1
        assert not (directory / mine).exists()
        assert (directory / theirs).exists()  # another name's: the exporter's business
        assert set(keep) <= set(os.listdir(directory))
    # Within the grace: left alone (its writer may still be at it).
    young = _killed_mid_write(directory, "engine")
    with Publisher(Ledger({"tp_rank": "0"}), directory, source="engine", interval=3600) as p:
        assert p.temporaries_removed == 0
        assert (directory / young).exists()
    assert canary.read_bytes() == b"keep"
