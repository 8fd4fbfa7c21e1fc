"""accounting.snapfile.writer: the Publisher, why a publish failed, the process it names."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from accounting.ledger import Ledger
from accounting.snapfile.directory import SnapshotDirError
from accounting.snapfile.format import ENVELOPE_SCHEMA, parse, snapshot_of
from accounting.snapfile.writer import Publisher, proc_stat
from accounting.snapshot import Snapshot
from tests.ledgers import small_ledger


def _read(path: str) -> dict:
    """The envelope with the whole snapshot dict, buffer rows included."""
    with open(path, "rb") as f:
        envelope, rows = parse(f.read())
    return {**envelope, "snapshot": snapshot_of(envelope, rows).to_dict()}


def test_publishes_envelope_with_heartbeat_and_removes_file_on_close(tmp_path):
    with small_ledger({"model_name": "m", "tp_rank": "3"}) as sl:
        sl.allocate(300)
        pub = Publisher(sl.ledger, tmp_path, interval=0.05)
        try:
            assert pub.source == f"m-tp3-pid{os.getpid()}"
            pub.publish()
            d = _read(pub.path)
            assert d["kvledger_publish"] == ENVELOPE_SCHEMA
            assert d["pid"] == os.getpid()
            stat = proc_stat(os.getpid())
            assert stat is not None and d["process_start"] == stat[1]
            snap = Snapshot.from_dict(d["snapshot"])
            assert snap.epoch == sl.ledger.epoch
            assert snap.rollup("family")[("swa_kv",)]["occupied_slots"] == 300
            first = d["published_at"]
            # the heartbeat advances with no ledger event in between
            deadline = time.monotonic() + 5
            while _read(pub.path)["published_at"] == first and time.monotonic() < deadline:
                time.sleep(0.01)
            later = _read(pub.path)
            assert later["published_at"] > first
            assert later["snapshot"]["epoch"] == snap.epoch
        finally:
            pub.close()
        assert not os.path.exists(pub.path)
        assert os.listdir(tmp_path) == []  # no temporaries left either
        pub.close()  # idempotent
        assert pub.closed


def test_context_manager_and_publish_after_close_writes_nothing(tmp_path):
    ledger = Ledger({"tp_rank": "0"})
    with Publisher(ledger, tmp_path, interval=10) as pub:
        pub.publish()
        assert os.path.exists(pub.path)
    assert not os.path.exists(pub.path)
    pub.publish()
    assert os.listdir(tmp_path) == []


def test_readers_never_see_a_torn_file(tmp_path):
    """A reader racing many publishes always parses a whole envelope."""
    with small_ledger() as sl:
        pub = Publisher(sl.ledger, tmp_path, interval=1000)
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            while not stop.is_set():
                sl.c4.occupy(1)
                pub.publish()
                sl.c4.release(1)
                pub.publish()

        t = threading.Thread(target=writer)
        pub.publish()
        t.start()
        reads = 0
        try:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    Snapshot.from_dict(_read(pub.path)["snapshot"])
                    reads += 1
                except BaseException as e:  # any torn read is a failure
                    errors.append(e)
                    break
        finally:
            stop.set()
            t.join()
            pub.close()
        assert not errors
        assert reads > 10


def test_publisher_thread_survives_a_failing_snapshot(tmp_path):
    ledger = Ledger({"tp_rank": "0"})
    calls = {"n": 0}

    def broken_truth(snap):
        calls["n"] += 1
        raise RuntimeError("device gone")

    ledger.add_truth(broken_truth)
    with Publisher(ledger, tmp_path, interval=0.02) as pub:
        deadline = time.monotonic() + 5
        while pub.errors < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.errors >= 2
        alive = {t.name for t in threading.enumerate() if t.is_alive()}
        assert f"kvledger-publisher-{pub.source}" in alive


def test_a_publisher_that_keeps_failing_logs_one_traceback_then_a_line_a_minute(tmp_path, caplog):
    ledger = Ledger({"tp_rank": "0"})
    broken = {"on": True}

    def truth(snap):
        if broken["on"]:
            raise OSError(2, "No such file or directory")
        return []

    ledger.add_truth(truth)
    caplog.set_level("INFO", logger="accounting.snapfile.publisher")
    with Publisher(ledger, tmp_path, interval=1000) as pub:
        for _ in range(5):
            pub._publish_safely()
        records = [r for r in caplog.records if r.name == "accounting.snapfile.publisher"]
        assert len(records) == 1 and records[0].exc_info is not None, records
        pub._failure_logged -= 61  # a minute later
        pub._publish_safely()
        records = [r for r in caplog.records if r.name == "accounting.snapfile.publisher"]
        assert len(records) == 2 and records[1].exc_info is None
        assert "still failing (7 times in a row): FileNotFoundError" in records[1].getMessage()
        broken["on"] = False
        pub._publish_safely()
        last = [r for r in caplog.records if r.name == "accounting.snapfile.publisher"][-1]
        assert "again, after 7 failures" in last.getMessage()
        assert pub.errors == 7


@pytest.mark.parametrize(
    "interval", [0, -1, "1", True, float("nan"), float("inf"), -float("inf"), 0.001, 7200]
)
def test_bad_interval_is_refused_naming_it(tmp_path, interval):
    with pytest.raises(ValueError, match="interval"):
        Publisher(Ledger(), tmp_path, interval=interval)


def test_directory_removed_under_the_publisher_is_recreated(tmp_path):
    import shutil

    d = tmp_path / "snap"
    with Publisher(Ledger({"tp_rank": "0"}), d, interval=1000) as pub:
        shutil.rmtree(d)
        pub.publish()
        assert os.path.exists(pub.path)


def test_bad_source_is_refused(tmp_path):
    with pytest.raises(ValueError, match="source"):
        Publisher(Ledger(), tmp_path, source="../escape")


def test_proc_stat_of_a_missing_pid_is_none():
    assert proc_stat(2**22 + 12345) is None


def test_a_busy_engine_publishes_from_its_allocating_thread_and_an_idle_one_from_the_thread(
    tmp_path, monkeypatch
):
    import threading

    from accounting.buffers import BufferSpec, Owner

    ledger = Ledger({"tp_rank": "0"})
    account = ledger.add_account(
        [BufferSpec("b", "c4_kv", "p", Owner.RUNTIME, 0, "uint8", (8,), 1, 1 << 30, 8, 8)]
    )
    who: list[str] = []
    real = Publisher.publish

    def recording(self):
        who.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Publisher, "publish", recording)
    with Publisher(ledger, tmp_path, interval=0.05) as pub:
        assert who == ["MainThread"]  # the first publish is the caller's
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # a busy engine: events all the time
            account.occupy(1)
            account.release(1)
        busy = list(who)
        assert busy.count("MainThread") >= 6  # about one per 50 ms interval
        assert all(name == "MainThread" for name in busy)  # the thread never had to
        seq = pub.sequence
        time.sleep(0.4)  # idle: no events, so the thread keeps the heartbeat going
        assert pub.sequence > seq
        assert any(name.startswith("kvledger-publisher") for name in who[len(busy) :])
    assert ledger.event_hook is None  # close() removed its hook


def test_links_planted_at_every_name_are_never_followed(tmp_path):
    """A link at the file's name is replaced; links at temporary-looking names are ignored
    (temporaries are created O_EXCL under unpredictable names); the targets keep their bytes."""
    canary = tmp_path / "canary"
    canary.write_bytes(b"secret")
    os.chmod(canary, 0o600)
    before = os.stat(canary)
    d = tmp_path / "snap"
    d.mkdir(mode=0o700)
    ledger = Ledger({"tp_rank": "0"})
    name = f"tp0-pid{os.getpid()}"
    for planted in (f"{name}.json", f".{name}.json.tmp", f".{name}.json.0000000000000000.tmp"):
        os.symlink(canary, d / planted)
    with Publisher(ledger, d, interval=1000) as pub:
        for _ in range(3):
            pub.publish()
        assert not os.path.islink(pub.path)
        assert parse(Path(pub.path).read_bytes())[0]["source"] == name
    assert canary.read_bytes() == b"secret"
    assert os.stat(canary).st_mtime_ns == before.st_mtime_ns


def test_close_removes_only_the_file_it_wrote(tmp_path):
    with Publisher(Ledger({"tp_rank": "0"}), tmp_path, interval=1000) as pub:
        other = tmp_path / "other"
        other.write_bytes(b"someone else's")
        os.replace(other, pub.path)  # replaced under the publisher
    assert Path(pub.path).read_bytes() == b"someone else's"


def test_a_directory_writable_by_others_is_refused(tmp_path):
    d = tmp_path / "snap"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(SnapshotDirError, match="writable by others"):
        Publisher(Ledger(), d)
    assert os.listdir(d) == []


def test_fsync_option_publishes_the_same_bytes(tmp_path):
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path / "a", interval=1000, fsync=True) as a:
        envelope, _ = parse(Path(a.path).read_bytes())
        assert envelope["snapshot"]["epoch"] == sl.ledger.epoch


def test_close_leaves_an_event_hook_someone_installed_since(tmp_path):
    ledger = Ledger({"tp_rank": "0"})

    def theirs() -> None:
        pass

    with Publisher(ledger, tmp_path, interval=1000):
        assert ledger.event_hook is not None
        ledger.set_event_hook(theirs)
    assert ledger.event_hook is theirs


# -- why a publish failed: issue 43 finding 4 ----------------------------------------------------
def _statvfs(*, bavail: int = 256, files: int = 8, favail: int = 8, flag: int = 0):
    """A filesystem of 4 KiB blocks as os.fstatvfs reports it."""
    return os.statvfs_result((4096, 4096, 256, bavail, bavail, files, favail, favail, flag, 255))


def _creating_fails(monkeypatch, err: int, fs) -> None:
    """Creating the temporary file fails with `err` (what a full inode table, a read-only
    mount or a directory without write permission give), the directory's statvfs is `fs`."""
    import errno as errno_

    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if isinstance(path, str) and path.startswith(".") and path.endswith(".tmp"):
            raise OSError(err, os.strerror(err), path)
        return real_open(path, flags, *args, **kwargs)

    assert err in errno_.errorcode
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: fs)


@pytest.mark.parametrize(
    "err, fs, reason, needle",
    [
        (28, _statvfs(favail=0), "no_inodes", "1048576 bytes and 0 of 8 inodes free"),
        (28, _statvfs(bavail=0), "no_space", "0 bytes and 8 of 8 inodes free"),
        (28, _statvfs(files=0, favail=0), "no_space", "of 0 inodes"),  # btrfs counts none
        (30, _statvfs(flag=os.ST_RDONLY), "read_only", "Read-only file system"),
        (13, _statvfs(), "permission", "Permission denied"),
        (13, _statvfs(flag=os.ST_RDONLY), "read_only", "Permission denied"),
    ],
)
def test_a_failed_publish_names_its_own_cause(tmp_path, monkeypatch, err, fs, reason, needle):
    """No inode left (ENOSPC with blocks free) is not no_space, EROFS is not permission: each
    has a reason of its own, and the detail says which of blocks and inodes ran out."""
    with Publisher(Ledger({"tp_rank": "0"}), tmp_path, interval=1000) as pub:
        with monkeypatch.context() as m:
            _creating_fails(m, err, fs)
            pub._publish_safely()
        assert pub.last_error is not None
        assert (pub.last_error.reason, pub.errors) == (reason, 1), pub.last_error
        assert needle in pub.last_error.detail, pub.last_error.detail
        assert {r: n for r, n in pub.errors_by_reason.items() if n} == {reason: 1}


def test_the_last_error_rides_only_in_the_publish_that_ends_the_failures(tmp_path, monkeypatch):
    """A cause that no longer holds is not carried on: the first file after a run of
    failures names the last one, the next files do not (their counts still do)."""
    with Publisher(Ledger({"tp_rank": "0"}), tmp_path, interval=1000) as pub:
        with monkeypatch.context() as m:
            _creating_fails(m, 28, _statvfs(bavail=0))
            pub._publish_safely()
            pub._publish_safely()
        pub._publish_safely()  # room again
        first = _read(pub.path)
        assert first["last_error"]["reason"] == "no_space"
        assert first["publish_errors"] == {"no_space": 2}
        pub._publish_safely()
        later = _read(pub.path)
        assert later["last_error"] is None and later["publish_errors"] == {"no_space": 2}
        assert pub.last_error is not None and pub.last_error.reason == "no_space"  # kept here
