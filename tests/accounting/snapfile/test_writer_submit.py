"""accounting.snapfile.writer: `Publisher.submit`, a snapshot taken by the caller and
encoded and written by the publisher's own thread."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger
from accounting.snapfile import writer
from accounting.snapfile.format import parse, snapshot_of
from accounting.snapfile.writer import Publisher
from accounting.snapshot import Snapshot

CAPACITY = 1000


def _ledger() -> tuple[Ledger, Account]:
    ledger = Ledger({"model_name": "m", "tp_rank": "0"})
    spec = BufferSpec(
        name="kv",
        family="kv",
        pool="p",
        owner=Owner.RUNTIME,
        layer=None,
        dtype="none",
        shape=(),
        slot_bytes=0,
        capacity_slots=CAPACITY,
        tensor_bytes=0,
        reserved_bytes=0,
    )
    return ledger, ledger.add_account([spec], key="p/kv")


def _set(acc: Account, slots: int) -> None:
    acc.on_slots(slots, max(acc.peak_occupied_slots, slots))


def _read(path: str) -> tuple[dict[str, Any], Snapshot]:
    with open(path, "rb") as f:
        envelope, rows = parse(f.read())
    return envelope, snapshot_of(envelope, rows)


def _occupied(snap: Snapshot) -> int:
    return int(snap.rollup("family")[("kv",)]["occupied_slots"])


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Gate:
    """The publisher directory's write, recorded (thread, bytes) and, while `hold` is set,
    stopped inside until `release()`: the publisher's thread is then busy writing."""

    def __init__(self, pub: Publisher, *, hold: bool = False, fail: OSError | None = None) -> None:
        self.pub = pub
        self.real = pub._dir.write_replace
        self.writes: list[tuple[int, bytes]] = []
        self.entered = threading.Event()
        self.go = threading.Event()
        if not hold:
            self.go.set()
        self.fail = fail
        pub._dir.write_replace = self  # type: ignore[method-assign]

    def __call__(self, name: str, data: bytes, **kw: Any) -> Any:
        self.writes.append((threading.get_ident(), data))
        self.entered.set()
        assert self.go.wait(10), "the test never released the write"
        if self.fail is not None:
            raise self.fail
        return self.real(name, data, **kw)

    def release(self) -> None:
        self.go.set()

    def figures(self) -> list[int]:
        out = []
        for _, data in self.writes:
            envelope, rows = parse(data)
            out.append(_occupied(snapshot_of(envelope, rows)))
        return out


@contextmanager
def _publisher(tmp_path: Any, ledger: Ledger) -> Iterator[Publisher]:
    pub = Publisher(ledger, tmp_path, interval=1000)  # no heartbeat during a test
    try:
        yield pub
    finally:
        pub.close()


def test_the_submitted_snapshot_is_the_one_written(tmp_path) -> None:
    ledger, acc = _ledger()
    _set(acc, 5)
    with _publisher(tmp_path, ledger) as pub:
        first = pub.sequence
        snap = ledger.snapshot()
        _set(acc, 9)  # the ledger moves on after the caller's instant
        assert pub.submit(snap) is snap
        _wait(lambda: pub.last_snapshot is snap, "the submitted write")
        envelope, written = _read(pub.path)
        assert envelope["sequence"] == first + 1
        assert _occupied(written) == 5 and written.epoch == snap.epoch  # the caller's instant
        assert written.taken_at == snap.taken_at
        assert pub.last_snapshot is snap
        # No snapshot given: taken on the caller's thread, at the call.
        now = pub.submit()
        assert _occupied(now) == 9
        _wait(lambda: pub.last_snapshot is now, "the second write")
        envelope, written = _read(pub.path)
        assert (envelope["sequence"], _occupied(written)) == (first + 2, 9)
        assert (pub.submitted, pub.replaced, pub.errors) == (2, 0, 0)


def test_a_newer_pending_snapshot_replaces_an_older_one(tmp_path) -> None:
    ledger, acc = _ledger()
    with _publisher(tmp_path, ledger) as pub:
        first = pub.sequence
        gate = _Gate(pub, hold=True)
        for slots in (1, 2, 3):
            _set(acc, slots)
            last = pub.submit(ledger.snapshot())
            if slots == 1:  # the thread is busy writing the first while 2 and 3 come
                assert gate.entered.wait(10)
        gate.release()
        _wait(lambda: len(gate.writes) == 2 and pub.last_snapshot is last, "two writes")
        time.sleep(0.05)  # nothing more comes
        assert gate.figures() == [1, 3]  # 2 was replaced before it was written
        assert (pub.submitted, pub.replaced, pub.sequence) == (3, 1, first + 2)
        envelope, written = _read(pub.path)
        assert (envelope["sequence"], _occupied(written)) == (first + 2, 3)


def test_close_with_a_pending_snapshot_drops_it_and_leaves_nothing(tmp_path) -> None:
    ledger, acc = _ledger()
    fds, threads = _fds(), set(threading.enumerate())
    pub = Publisher(ledger, tmp_path, interval=1000)
    gate = _Gate(pub, hold=True)
    _set(acc, 1)
    pub.submit()
    assert gate.entered.wait(10)  # writing the first
    _set(acc, 2)
    pub.submit()  # pending while close() runs
    closer = threading.Thread(target=pub.close)
    closer.start()
    _wait(pub._stop.is_set, "close() to stop the publisher")
    gate.release()
    closer.join(10)
    assert not closer.is_alive()
    assert gate.figures() == [1]  # the one being written is finished, the pending one dropped
    assert pub.closed and pub._pending is None
    assert not os.path.exists(pub.path) and os.listdir(tmp_path) == []
    assert set(threading.enumerate()) == threads
    assert _fds() == fds
    # After close, a submit keeps and writes nothing.
    snap = pub.submit()
    assert isinstance(snap, Snapshot) and pub._pending is None
    assert os.listdir(tmp_path) == [] and set(threading.enumerate()) == threads


def test_close_right_after_a_submit_leaves_nothing(tmp_path) -> None:
    ledger, acc = _ledger()
    fds, threads = _fds(), set(threading.enumerate())
    for n in range(20):
        pub = Publisher(ledger, tmp_path, interval=1000)
        _set(acc, n)
        pub.submit()
        pub.close()
        assert os.listdir(tmp_path) == [], n
        assert set(threading.enumerate()) == threads and _fds() == fds, n


def test_a_failing_write_is_counted_and_logged_and_the_thread_carries_on(tmp_path, caplog) -> None:
    caplog.set_level("INFO", logger="accounting.snapfile.publisher")
    ledger, acc = _ledger()
    with _publisher(tmp_path, ledger) as pub:
        first = pub.sequence
        gate = _Gate(pub, fail=OSError(errno.EACCES, "Permission denied"))
        _set(acc, 4)
        pub.submit()

        def logged() -> list[Any]:
            return [r for r in caplog.records if r.name == "accounting.snapfile.publisher"]

        _wait(lambda: pub.errors == 1 and bool(logged()), "the failure to be counted and logged")
        assert pub.errors_by_reason["permission"] == 1
        assert pub.last_error is not None and pub.last_error.reason == "permission"
        assert len(logged()) == 1 and logged()[0].exc_info is not None
        assert pub._thread.is_alive()
        gate.fail = None
        _set(acc, 6)
        snap = pub.submit()
        _wait(lambda: pub.last_snapshot is snap, "the write after the failure")
        assert pub.sequence == first + 2
        envelope, written = _read(pub.path)
        assert _occupied(written) == 6
        assert envelope["publish_errors"] == {"permission": 1}
        assert envelope["last_error"]["reason"] == "permission"  # the file ending the run
        _wait(lambda: len(logged()) == 2, "the line saying it works again")
        assert "again, after 1 failures" in logged()[-1].getMessage()
        assert pub._thread.is_alive()


def test_the_callers_thread_does_no_file_io_nor_encoding(tmp_path, monkeypatch) -> None:
    ledger, acc = _ledger()
    encoded: list[int] = []
    real_encode = writer.encode

    def encode(*args: Any) -> bytes:
        encoded.append(threading.get_ident())
        return real_encode(*args)

    with _publisher(tmp_path, ledger) as pub:
        gate = _Gate(pub)
        monkeypatch.setattr(writer, "encode", encode)
        for n in range(5):
            _set(acc, n)
            snap = pub.submit()
            _wait(lambda: pub.last_snapshot is snap, "each write")  # noqa: B023 (called here)
        ident = pub._thread.ident
        assert ident is not None and ident != threading.get_ident()
        assert [t for t, _ in gate.writes] == [ident] * 5
        assert encoded == [ident] * 5
        # publish() stays synchronous, on the caller's thread.
        pub.publish()
        assert gate.writes[-1][0] == encoded[-1] == threading.get_ident()


def test_an_older_snapshot_is_never_written_after_a_newer_one(tmp_path) -> None:
    ledger, acc = _ledger()
    with _publisher(tmp_path, ledger) as pub:
        gate = _Gate(pub)
        _set(acc, 1)
        old = ledger.snapshot()
        order = next(pub._taken)  # its place, taken before the publish below
        _set(acc, 2)
        pub.publish()
        seq = pub.sequence
        pub._write_submitted(order, old)  # the thread's write, overtaken
        assert pub.sequence == seq and gate.figures() == [2]
        assert _occupied(_read(pub.path)[1]) == 2


def test_submit_refuses_what_is_not_a_snapshot(tmp_path) -> None:
    ledger, _ = _ledger()
    with _publisher(tmp_path, ledger) as pub:
        with pytest.raises(TypeError, match=r"snapshot=\{'a': 1\}, expected an accounting"):
            pub.submit({"a": 1})  # type: ignore[arg-type]
        assert pub._pending is None and pub.submitted == 0
