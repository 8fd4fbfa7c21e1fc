"""`kvledger serve` when the snapshot directory changes under it: replaced by another user's
after start, created below missing parents under umask 000, or below a parent others can
write. Live server (real uvicorn), a source published from this process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from accounting.ledger import Ledger
from accounting.snapfile.writer import Publisher
from tests.hostile import as_nobody, nobody_uid, shared_tmp
from tests.servers import ServeProcess, repo_env, wait_until

pytestmark = pytest.mark.slow


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]


def _up(url: str) -> dict[str, float]:
    return {labels["model_name"]: v for labels, v in _samples(url, "kvledger_up")}


def _usable(url: str) -> float:
    return _samples(url, "kvledger_snapshot_dir_usable")[0][1]


@pytest.mark.skipif(nobody_uid() is None, reason="needs root and a 'nobody' user")
def test_a_directory_replaced_by_another_user_keeps_its_sources_listed_down():
    with shared_tmp() as tmp:
        snap = tmp / "snap"
        server = ServeProcess(
            ["--port", "0", "--no-demo", "--snapshot-dir", str(snap), "--log-interval", "3600"]
        )
        publisher = Publisher(Ledger({"model_name": "good", "tp_rank": "0"}), snap, interval=0.2)
        try:
            wait_until(lambda: _up(server.url) == {"good": 1}, 20, "the source is up")
            assert _usable(server.url) == 1
            # Another user's directory takes the path (created beside it, renamed in).
            as_nobody(f"import os; os.mkdir({str(tmp / 'evil')!r}, 0o777)")
            os.rename(snap, tmp / "snap.old")
            os.rename(tmp / "evil", snap)
            wait_until(lambda: _up(server.url) == {"good": 0}, 10, "the source listed down")
            assert _usable(server.url) == 0
            srcs = httpx.get(f"{server.url}/debug/kv", timeout=5).json()["sources"]
            assert len(srcs) == 1 and not srcs[0]["up"]
            reason = srcs[0]["stale_reason"]
            assert "snapshot directory not usable" in reason, reason
            assert f"owned by uid {nobody_uid()}" in reason, reason
            assert os.listdir(snap) == []  # nothing written into the other user's directory
            # The right directory back: served again.
            os.rename(snap, tmp / "evil")
            os.rename(tmp / "snap.old", snap)
            wait_until(lambda: _up(server.url) == {"good": 1}, 10, "the source up again")
            assert _usable(server.url) == 1
        finally:
            publisher.close()
            assert server.close() == 0


def test_missing_parents_are_created_0755_whatever_the_umask(tmp_path):
    snap = tmp_path / "a" / "b" / "snap"
    server = ServeProcess(
        ["--port", "0", "--no-demo", "--snapshot-dir", str(snap)],
        preexec_fn=lambda: os.umask(0),  # type: ignore[arg-type]
    )
    try:
        for d in (tmp_path / "a", tmp_path / "a" / "b"):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o755, d
        assert stat.S_IMODE(os.stat(snap).st_mode) == 0o700
    finally:
        assert server.close() == 0


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_parent_others_can_write_is_refused_at_start(tmp_path, mode):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, mode)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "kvledger", "serve", "--port", "0", "--no-demo"),
            *("--snapshot-dir", str(parent / "snap")),
        ],
        capture_output=True,
        text=True,
        env=repo_env(),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"parent {parent}" in lines[0], proc.stderr
    assert "without the sticky bit" in lines[0]
    assert not (parent / "snap").exists()


def test_a_sticky_parent_like_tmp_is_accepted(tmp_path):
    parent = tmp_path / "sticky"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    server = ServeProcess(["--port", "0", "--no-demo", "--snapshot-dir", str(parent / "snap")])
    try:
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    finally:
        assert server.close() == 0
