"""`kvledger serve` with its snapshot directory on a full filesystem (a small tmpfs): the
source goes down, and /metrics and /debug/kv say "no space", not only "stale"; once room
is made it is up again and its publisher's failures are counted in its file."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from accounting.ledger import Ledger
from accounting.snapfile.writer import Publisher
from tests.servers import ServeProcess, wait_until

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _tmpfs(size: str, *options: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvledger-tmpfs-"))
    try:
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        opts = ",".join((f"size={size}", "mode=0700", *options))
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        try:
            yield d
        finally:
            subprocess.run(["umount", "-l", str(d)], check=False)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def _samples(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and s.labels.get("model_name") == "full"
    }


def _source(url: str) -> dict:
    (src,) = [
        s
        for s in httpx.get(f"{url}/debug/kv", timeout=5).json()["sources"]
        if s["labels"].get("model_name") == "full"
    ]
    return src


def test_a_full_disk_shows_as_no_space_then_recovers():
    with _tmpfs("1m") as fs:
        snap = fs / "snap"
        server = ServeProcess(
            ["--port", "0", "--no-demo", "--snapshot-dir", str(snap), "--log-interval", "3600"]
        )
        publisher = Publisher(Ledger({"model_name": "full", "tp_rank": "0"}), snap, interval=0.2)
        try:
            wait_until(lambda: _source(server.url)["up"], 20, "the source is up")
            assert _samples(server.url, "kvledger_source_last_error") == {}
            _fill(fs / "filler")
            wait_until(lambda: not _source(server.url)["up"], 10, "the source is down")
            src = _source(server.url)
            assert src["last_error"]["reason"] == "no_space", src
            assert "bytes free" in src["last_error"]["detail"]
            assert _samples(server.url, "kvledger_source_last_error") == {"no_space": 1}
            assert publisher.errors_by_reason["no_space"] > 0
            assert publisher.last_error is not None and publisher.last_error.reason == "no_space"
            os.unlink(fs / "filler")
            wait_until(lambda: _source(server.url)["up"], 10, "the source is up again")
            # Up: no last error shown as a down reason, the failures counted in its file.
            assert _samples(server.url, "kvledger_source_last_error") == {}
            errors = _samples(server.url, "kvledger_publish_errors_total")
            assert errors["no_space"] >= 1 and errors["permission"] == 0, errors
            src = _source(server.url)
            assert src["publish_errors"]["no_space"] >= 1 and src["last_error"] is None
        finally:
            publisher.close()
            assert server.close() == 0


def _use_every_inode(directory: Path) -> list[Path]:
    made: list[Path] = []
    try:
        while True:
            path = directory / f"inode-{len(made)}"
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            made.append(path)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    assert os.statvfs(directory).f_bavail > 0  # blocks to spare: only the inodes ran out
    return made


def _remount(fs: Path, mode: str) -> None:
    r = subprocess.run(["mount", "-o", f"remount,{mode}", str(fs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount {mode} here: {r.stderr.strip()}")


def _gauge(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    (value,) = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvledger_snapshot_dir_usable"
    ]
    return value


def _directory_problems(url: str) -> list[str]:
    problems = httpx.get(f"{url}/debug/kv", timeout=5).json()["files_not_served"]
    return [p["reason"] for p in problems if p["name"] == ""]


def test_no_inodes_then_a_read_only_remount_each_show_their_own_cause():
    """Issue 43 finding 4 on a real filesystem: with no inode left, the source's last error
    is no_inodes (before: nothing but an old heartbeat) and the directory gauge 0; once
    inodes are free it is up, the gauge 1. A read-only remount then shows read_only (before:
    no_space, the earlier cause, and EROFS counted as permission); writable again, nothing."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with _tmpfs("4m", "nr_inodes=64") as fs:
        snap = fs / "snap"
        server = ServeProcess(
            ["--port", "0", "--no-demo", "--snapshot-dir", str(snap), "--log-interval", "3600"]
        )
        publisher = Publisher(Ledger({"model_name": "full", "tp_rank": "0"}), snap, interval=0.2)
        try:
            wait_until(lambda: _source(server.url)["up"], 20, "the source is up")
            assert _gauge(server.url) == 1
            made = _use_every_inode(fs)
            wait_until(lambda: not _source(server.url)["up"], 10, "the source is down")
            src = _source(server.url)
            assert src["last_error"]["reason"] == "no_inodes", src
            assert _samples(server.url, "kvledger_source_last_error") == {"no_inodes": 1}
            assert _gauge(server.url) == 0
            assert _directory_problems(server.url) == ["no_inodes"]
            assert publisher.last_error is not None
            assert publisher.last_error.reason == "no_inodes", publisher.last_error
            for path in made:
                path.unlink()
            wait_until(lambda: _source(server.url)["up"], 10, "the source is up again")
            assert _gauge(server.url) == 1 and _directory_problems(server.url) == []
            assert _samples(server.url, "kvledger_source_last_error") == {}
            _remount(fs, "ro")
            try:
                wait_until(lambda: not _source(server.url)["up"], 10, "down on the ro mount")
                src = _source(server.url)
                assert src["last_error"]["reason"] == "read_only", src
                assert _samples(server.url, "kvledger_source_last_error") == {"read_only": 1}
                assert _gauge(server.url) == 0
                assert _directory_problems(server.url) == ["read_only"]
                assert publisher.errors_by_reason["read_only"] > 0
                assert publisher.errors_by_reason["permission"] == 0
            finally:
                _remount(fs, "rw")
            wait_until(lambda: _source(server.url)["up"], 10, "up again once writable")
            assert _gauge(server.url) == 1
            errors = _samples(server.url, "kvledger_publish_errors_total")
            assert errors["no_inodes"] >= 1 and errors["read_only"] >= 1, errors
            assert errors["permission"] == 0 and errors["no_space"] == 0, errors
        finally:
            publisher.close()
            assert server.close() == 0


def test_at_the_file_size_limit_the_demo_logs_a_few_lines_not_thousands(tmp_path):
    """The demo's host pool cannot grow its memfd past RLIMIT_FSIZE: every workload step
    fails (20 ms apart, at 50 requests/s); the log keeps to a few lines, one traceback."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))

    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        server = ServeProcess(
            [
                *("--port", "0", "--snapshot-dir", str(tmp_path / "snap")),
                *("--rate", "50", "--log-interval", "3600"),
            ],
            stderr=err,
            preexec_fn=limit,
        )
        try:
            wait_until(
                lambda: "workload step failed" in log.read_text(errors="replace"),
                30,
                "the workload fails at the limit",
            )
            time.sleep(5)  # ~250 failing steps
            assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        finally:
            assert server.close() == 0
    text = log.read_text(errors="replace")
    assert text.count("workload step failed") == 1, text[-3000:]
    assert text.count("Traceback (most recent call last)") <= 2, text[-3000:]  # one, chained
    assert len(text.splitlines()) < 80, text[-3000:]
