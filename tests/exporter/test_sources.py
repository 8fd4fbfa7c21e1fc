from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from accounting.ledger import Ledger
from accounting.snapfile.directory import SnapshotDirError
from accounting.snapfile.format import parse
from accounting.snapfile.writer import Publisher
from exporter.sources import BufferMapError, Sources
from tests.hostile import nobody_uid
from tests.ledgers import small_ledger


def _plant(directory: Path, name: str, envelope: dict, rows: bytes, **changes) -> Path:
    """A file like a publisher's, named `name`.json, its envelope changed by `changes`."""
    d = {**envelope, "source": name, **changes}
    path = directory / f"{name}.json"
    path.write_bytes(json.dumps(d).encode() + b"\n" + rows)
    return path


def test_reads_published_files_and_caches_by_file_identity(tmp_path):
    with small_ledger({"model_name": "m", "tp_rank": "0"}) as sl:
        with Publisher(sl.ledger, tmp_path, interval=1000) as pub:
            pub.publish()
            src = Sources(tmp_path)
            scan = src.read()
            [v] = scan.views
            assert v.up and v.source == pub.source
            assert v.snapshot.epoch == sl.ledger.epoch
            assert scan.files.parses == 1
            src.read()
            assert src.read().files.parses == 1  # unchanged file: no parse
            sl.allocate(10)
            pub.publish()
            scan = src.read()
            [v] = scan.views
            assert scan.files.parses == 2
            assert v.summary.totals.occupied_slots == 10
            assert v.snapshot.rollup("family")[("swa_kv",)]["occupied_slots"] == 10
        assert src.read().views == ()  # closed publisher: its file and its source are gone


def test_in_process_ledger_is_read_live(tmp_path):
    with small_ledger() as sl:
        src = Sources()
        name = src.add_ledger(sl.ledger)
        sl.allocate(5)
        [v] = src.read().views
        assert v.source == name and v.up and v.published.interval == 0
        assert v.snapshot.epoch == sl.ledger.epoch
        src.remove_ledger(name)
        assert src.read().views == ()


def test_old_heartbeat_marks_stale_with_reason(tmp_path):
    now = [1000.0]
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        d, _ = parse(Path(pub.path).read_bytes())
        src = Sources(tmp_path, stale_after=5, clock=lambda: now[0])
        now[0] = d["published_at"] + 4
        [v] = src.read().views
        assert v.up
        now[0] = d["published_at"] + 6
        [v] = src.read().views
        assert not v.up
        assert "heartbeat" in (v.stale_reason or "") and "5.0 s" in (v.stale_reason or "")
        assert v.age_seconds >= 6


def test_liveness_is_the_heartbeat_not_the_snapshots_age(tmp_path, monkeypatch):
    """A publisher that heartbeats a snapshot taken long ago (nothing moved since) is up:
    the age is reported, but only the heartbeat decides."""
    now = [0.0]
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        taken = sl.ledger.snapshot
        monkeypatch.setattr(
            sl.ledger,
            "snapshot",
            lambda *a, **k: dataclasses.replace(taken(*a, **k), taken_at=time.time() - 100),
        )
        pub.publish()
        d, _ = parse(Path(pub.path).read_bytes())
        src = Sources(tmp_path, stale_after=5, clock=lambda: now[0])
        now[0] = d["published_at"] + 1
        [v] = src.read().views
        assert v.up, v.stale_reason
        assert v.age_seconds > 90 and v.heartbeat_age_seconds < 5


def test_stale_sources_are_forgotten_after_the_bound(tmp_path):
    now = [0.0]
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        d, _ = parse(Path(pub.path).read_bytes())
        src = Sources(tmp_path, stale_after=5, forget_after=60, clock=lambda: now[0])
        now[0] = d["published_at"] + 30
        [v] = src.read().views
        assert not v.up
        now[0] = d["published_at"] + 61
        assert src.read().views == ()
        assert os.path.exists(pub.path)  # forgotten, not deleted


def test_dead_pid_is_listed_down_until_a_restart_takes_its_place(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with small_ledger({"model_name": "m", "tp_rank": "0"}) as sl:
        with Publisher(sl.ledger, tmp_path, interval=1000) as pub:
            envelope, rows = parse(Path(pub.path).read_bytes())
        # A crashed rank: its file stays, its pid is gone; nothing has replaced it yet.
        dead = _plant(tmp_path, "dead", envelope, rows, pid=child.pid)
        src = Sources(tmp_path)
        [v] = src.read().views
        assert not v.up and f"pid {child.pid} has exited" in (v.stale_reason or "")
        assert dead.exists()
        # The restart publishes with the same engine labels: the dead one goes, file and all.
        with Publisher(sl.ledger, tmp_path, interval=1000) as pub:
            [v] = src.read().views
            assert v.source == pub.source and v.up
            assert not dead.exists() and src.removed == 1


def test_reused_pid_marks_stale(tmp_path):
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        envelope, rows = parse(Path(pub.path).read_bytes())
        _plant(tmp_path, "reused", envelope, rows, process_start=envelope["process_start"] - 1)
        os.unlink(pub.path)  # alone, so no live source takes its place
        [v] = Sources(tmp_path).read().views
        assert v.source == "reused" and "another process" in (v.stale_reason or "")


def test_two_live_sources_with_the_same_engine_labels_are_both_a_conflict(tmp_path):
    """A second file that imitates an engine cannot replace its series: neither is believed."""
    labels = {"model_name": "m", "tp_rank": "0"}
    with small_ledger(labels) as sl, Publisher(sl.ledger, tmp_path, source="real") as real:
        envelope, rows = parse(Path(real.path).read_bytes())
        _plant(tmp_path, "imitation", envelope, rows)
        views = {v.source: v for v in Sources(tmp_path).read().views}
        assert set(views) == {"real", "imitation"}
        assert not views["real"].up and not views["imitation"].up
        assert "conflict: imitation" in (views["real"].stale_reason or "")
        assert "conflict: real" in (views["imitation"].stale_reason or "")
        os.unlink(tmp_path / "imitation.json")
        [v] = Sources(tmp_path).read().views
        assert v.source == "real" and v.up


def test_files_that_are_not_snapshots_are_refused_once_per_version(tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}) + "\n[]")
    (tmp_path / ".x.tmp").write_text("partial")
    (tmp_path / "notes.txt").write_text("hi")
    src = Sources(tmp_path)
    scan = src.read()
    assert scan.views == ()
    assert {p.name: p.reason for p in scan.files.problems} == {
        "junk.json": "parse",
        "other.json": "schema",
    }
    parses = scan.files.parses
    for _ in range(3):
        scan = src.read()
    assert scan.files.parses == parses  # refused files are not read again while unchanged
    assert scan.files.error_counts["parse"] == 1 and scan.files.error_counts["schema"] == 1
    os.unlink(tmp_path / "junk.json")
    scan = src.read()
    assert scan.files.unreadable == 1 and [p.name for p in scan.files.problems] == ["other.json"]
    (tmp_path / "other.json").write_text("[1]\n[]")  # a new version is read again
    assert src.read().files.error_counts["schema"] == 2


def test_bad_buffer_rows_fail_that_buffer_map_only_and_are_counted_once(tmp_path):
    """The rows are parsed when the buffer map is asked for, once per version; a failure
    there leaves that source's summary (its metrics) and every other source alone."""
    with small_ledger({"model_name": "m", "tp_rank": "0"}) as sl:
        sl.allocate(10)
        with Publisher(sl.ledger, tmp_path, interval=1000, source="good") as pub:
            envelope, rows = parse(Path(pub.path).read_bytes())
            buffers = json.loads(rows)
            buffers[0]["physical_bytes"] = float("nan")
            labels = {**envelope["snapshot"]["labels"], "model_name": "other"}
            snap = {**envelope["snapshot"], "labels": labels}
            _plant(tmp_path, "bad", {**envelope, "snapshot": snap}, json.dumps(buffers).encode())
            src = Sources(tmp_path)
            scan = src.read()
            views = {v.source: v for v in scan.views}
            assert views["bad"].up and views["good"].up and scan.files.parses == 2
            assert scan.files.problems == () and scan.files.error_counts["buffers"] == 0
            assert views["bad"].summary.totals == views["good"].summary.totals
            for _ in range(2):
                snap_, error = views["bad"].published.buffer_map()
                assert snap_ is None and error is not None
                assert error.startswith("schema: buffers[0]: physical_bytes")
            assert src.read().files.error_counts["buffers"] == 1  # counted once, in the next scan
            with pytest.raises(BufferMapError, match="source bad: buffer map not served"):
                _ = views["bad"].snapshot
            good, error = views["good"].published.buffer_map()
            assert error is None and good is not None and len(good.buffers) == len(buffers)
            scan = src.read()
            [bad] = [v for v in scan.views if v.source == "bad"]
            assert bad.published is views["bad"].published  # same version: not parsed again
            assert scan.files.parses == 2 and scan.files.error_counts["buffers"] == 1


def test_links_fifos_devices_and_big_files_are_refused_without_reading(tmp_path):
    canary = tmp_path / "canary.bin"
    canary.write_bytes(b"x")
    d = tmp_path / "snap"
    d.mkdir(mode=0o700)
    os.symlink("/dev/zero", d / "zero.json")
    os.symlink(canary, d / "link.json")
    os.mkfifo(d / "fifo.json")
    (d / "dir.json").mkdir()
    with open(d / "big.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: nothing is read, the size alone refuses it
    expected = {
        "zero.json": "symlink",
        "link.json": "symlink",
        "fifo.json": "not_regular",
        "dir.json": "not_regular",
        "big.json": "too_large",
    }
    if os.geteuid() == 0:
        os.mknod(d / "null.json", 0o600 | 0o020000, os.makedev(1, 3))  # /dev/null's numbers
        expected["null.json"] = "not_regular"
    scan = Sources(d).read()
    assert scan.views == ()
    assert {p.name: p.reason for p in scan.files.problems} == expected
    assert canary.read_bytes() == b"x"


@pytest.mark.skipif(nobody_uid() is None, reason="needs root and a 'nobody' user")
def test_a_file_owned_by_another_user_is_refused(tmp_path):
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        envelope, rows = parse(Path(pub.path).read_bytes())
    planted = _plant(tmp_path, "planted", envelope, rows)
    uid = nobody_uid()
    assert uid is not None
    os.chown(planted, uid, -1)
    scan = Sources(tmp_path).read()
    assert scan.views == ()
    [p] = scan.files.problems
    assert p.reason == "owner" and f"uid {nobody_uid()}" in p.detail


def test_caps_on_files_and_parses_per_scan(tmp_path):
    for i in range(30):
        (tmp_path / f"junk{i:02d}.json").write_text("nope")
    src = Sources(tmp_path)
    files = src.files
    assert files is not None
    files.max_files, files.max_parses = 20, 8
    assert src.read().files.parses == 8 and files.skipped == 10
    src.read()
    scan = src.read()
    assert scan.files.parses == 20  # the rest of the first 20, 8 per scan
    [first, *_] = scan.files.problems
    assert first.reason == "too_many_files" and "10 files" in first.detail
    assert scan.files.error_counts["too_many_files"] == 1


def test_missing_directory_reads_empty_until_it_exists(tmp_path):
    src = Sources(tmp_path / "nope")
    scan = src.read()
    assert scan.views == ()
    assert "does not exist" in scan.files.problems[0].detail
    with Publisher(Ledger({"tp_rank": "0"}), tmp_path / "nope", interval=1000):
        scan = src.read()
        [v] = scan.views
        assert v.up and scan.files.problems == ()
    assert src.read().files.problems == ()


def test_an_existing_bad_directory_is_refused_at_once(tmp_path):
    os.chmod(tmp_path, 0o777)
    with pytest.raises(SnapshotDirError, match="writable by others"):
        Sources(tmp_path)


def test_a_directory_replaced_later_keeps_its_sources_listed_down_and_says_why(tmp_path):
    d = tmp_path / "snap"
    with Publisher(Ledger({"tp_rank": "0"}), d, interval=1000) as pub:
        src = Sources(d)
        assert len(src.read().views) == 1 and src.read().files.directory_problem is None
        os.rename(d, tmp_path / "old")
        d.mkdir()
        os.chmod(d, 0o777)
        scan = src.read()
        (view,) = scan.views  # still listed, down, with the directory's problem
        assert not view.up and view.stale_reason is not None
        assert view.stale_reason.startswith("snapshot directory not usable: ")
        assert "writable by others" in view.stale_reason
        assert "writable by others" in scan.files.problems[0].detail
        assert scan.files.directory_problem is not None
        os.rmdir(d)
        os.rename(tmp_path / "old", d)
        (view,) = src.read().views
        assert view.up
        pub.close()
    src.close()
    src.close()


def test_background_scanning_parses_files_before_anyone_reads(tmp_path):
    with Publisher(Ledger({"tp_rank": "0"}), tmp_path, interval=1000) as pub:
        src = Sources(tmp_path)
        src.start_scanning(0.02)
        with pytest.raises(RuntimeError, match="already"):
            src.start_scanning(0.02)
        files = src.files
        assert files is not None
        deadline = time.monotonic() + 5
        while files.parses == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert files.parses == 1
        pub.publish()
        while files.parses == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert files.parses == 2
        scan = src.read()
        [v] = scan.views
        assert scan.files.parses == 2 and v.published.sequence == pub.sequence  # parsed already
        src.close()
        assert "kvledger-scan" not in {t.name for t in threading.enumerate()}
        src.close()  # idempotent


def test_an_in_process_ledger_whose_snapshot_fails_is_left_out_named_and_counted(tmp_path, caplog):
    """One ledger that cannot be snapshotted costs that source only: the others are read."""
    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as good,
        small_ledger({"model_name": "m", "tp_rank": "1"}) as bad,
    ):

        def broken(snap):
            raise RuntimeError("device gone")

        bad.ledger.add_truth(broken)
        src = Sources()
        src.add_ledger(good.ledger, source="good")
        src.add_ledger(bad.ledger, source="bad")
        for _ in range(3):
            scan = src.read()
            assert [v.source for v in scan.views] == ["good"]
        assert scan.source_errors == {"snapshot": 3}
        lines = [r for r in caplog.records if "source bad left out" in r.getMessage()]
        assert len(lines) == 1 and "device gone" in lines[0].getMessage()  # rate-limited


def test_a_background_scan_failing_every_time_logs_once_a_minute(tmp_path, caplog, monkeypatch):
    """EMFILE on every scan (0.01 s apart): one line with the traceback, not fifty."""
    import errno
    import logging

    src = Sources(tmp_path)
    assert src.files is not None

    def emfile(now: float, keep_young: float = 0.0) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(src.files, "scan", emfile)
    with caplog.at_level(logging.ERROR, logger="exporter.sources"):
        src.start_scanning(0.01)
        time.sleep(0.5)
        src.close()
    lines = [r for r in caplog.records if "background scan" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "Too many open files" in lines[0].getMessage() and lines[0].exc_info


# -- a directory no publisher can write: issue 43 finding 4 ---------------------------------------
def _fs(*, bavail: int = 1 << 20, favail: int = 900, flag: int = 0):
    """A filesystem of 4 KiB blocks and 1,000 inodes as os.fstatvfs reports it."""
    return os.statvfs_result((4096, 4096, 1 << 21, bavail, bavail, 1000, favail, favail, flag, 255))


def _down(tmp_path, pub):
    """Sources over `tmp_path` whose clock puts `pub`'s heartbeat 6 s old (down)."""
    d, _ = parse(Path(pub.path).read_bytes())
    return Sources(tmp_path, stale_after=5, clock=lambda: d["published_at"] + 6)


@pytest.mark.parametrize(
    "fs, writable, reason, needle",
    [
        (_fs(favail=0), True, "no_inodes", "no inode left"),
        (_fs(flag=os.ST_RDONLY), False, "read_only", "mounted read-only"),
        (_fs(), False, "permission", "does not let uid"),
        (_fs(bavail=0), True, "no_space", "0 bytes free"),
    ],
)
def test_a_down_source_names_the_directorys_cause_while_it_holds(
    tmp_path, monkeypatch, fs, writable, reason, needle
):
    """No inodes, a read-only mount, no permission: each is the down source's last error
    (kvledger_source_last_error, /debug/kv) and the scan's write problem (the directory
    gauge) while it holds, and neither once it does not. Before, no inodes, read-only and
    permission showed nothing but an old heartbeat."""
    with Publisher(Ledger({"tp_rank": "0"}), tmp_path, interval=1000) as pub:
        src = _down(tmp_path, pub)
        [v] = src.read().views
        assert not v.up and v.last_error is None
        with monkeypatch.context() as m:
            m.setattr(os, "fstatvfs", lambda fd: fs)
            m.setattr(os, "access", lambda *a, **k: writable)
            scan = src.read()
        [v] = scan.views
        assert v.last_error is not None and v.last_error.reason == reason, v.last_error
        assert needle in v.last_error.detail
        assert scan.files.write_problem is not None
        assert scan.files.write_problem.reason == reason
        scan = src.read()  # it no longer holds
        [v] = scan.views
        assert v.last_error is None and scan.files.write_problem is None
        src.close()


def test_an_earlier_episodes_cause_is_not_shown_as_the_current_one(tmp_path, monkeypatch):
    """A publisher that recovered from a full disk, then went silent under a read-only
    remount: the source shows read_only (before: no_space, the earlier episode's), and
    once the mount is writable and roomy no cause at all (the exporter looked: no_space
    no longer holds)."""
    real_open = os.open

    def no_room(path, flags, *args, **kwargs):
        if isinstance(path, str) and path.startswith(".") and path.endswith(".tmp"):
            raise OSError(28, "No space left on device", path)
        return real_open(path, flags, *args, **kwargs)

    with Publisher(Ledger({"tp_rank": "0"}), tmp_path, interval=1000) as pub:
        with monkeypatch.context() as m:
            m.setattr(os, "open", no_room)
            m.setattr(os, "fstatvfs", lambda fd: _fs(bavail=0))
            pub._publish_safely()
        pub._publish_safely()  # room again: this file names the no_space it ends
        assert parse(Path(pub.path).read_bytes())[0]["last_error"]["reason"] == "no_space"
        src = _down(tmp_path, pub)
        with monkeypatch.context() as m:
            m.setattr(os, "fstatvfs", lambda fd: _fs(flag=os.ST_RDONLY))
            m.setattr(os, "access", lambda *a, **k: False)
            [v] = src.read().views
        assert not v.up and v.last_error is not None and v.last_error.reason == "read_only"
        [v] = src.read().views
        assert v.last_error is None, v.last_error
        src.close()


def test_a_publishers_own_cause_the_exporter_cannot_see_is_still_shown(tmp_path, monkeypatch):
    """What the exporter cannot look for itself (an error of the engine's, `other`) stays the
    down source's last error, from the file that ended the failures."""
    ledger = Ledger({"tp_rank": "0"})
    broken = {"on": True}

    def truth(snap):
        if broken["on"]:
            raise RuntimeError("device gone")
        return []

    ledger.add_truth(truth)
    with Publisher(ledger, tmp_path, interval=1000) as pub:
        broken["on"] = False
        pub._publish_safely()
        src = _down(tmp_path, pub)
        [v] = src.read().views
        assert v.last_error is not None and v.last_error.reason == "other"
        src.close()
