"""The writer: a ledger's snapshots published to a directory, one file per source.

Every `interval` seconds a `Publisher` takes `ledger.snapshot()` and writes it,
with its envelope (`accounting.snapfile.format`: who published it, when, the
heartbeat), to `<directory>/<source>.json`. The directory is opened once and
checked (`accounting.snapfile.directory`: ours or root's, not writable by others,
created 0700); each file is written whole to a new file under an unpredictable
name (O_CREAT | O_EXCL | O_NOFOLLOW) and renamed over the old one, all relative
to the directory's descriptor, so a reader sees either the previous file or the
next, never a torn one, and a planted link is never followed. `close()` removes
the file only if it is still the one this publisher wrote. A new publisher removes
the temporary files an earlier one of its name left when it was killed mid-write
(older than `temp_grace`; the exporter sweeps every name's too).

Who publishes: while the engine allocates, the allocating thread itself, when a
publish is due (the ledger's event hook checks a monotonic deadline every 64
events: O(1), and one snapshot of O(buffers) per interval, never O(slots)). A
thread of its own covers an idle engine, waking only when a publish is an interval
overdue. A second thread publishing beside a busy allocating thread was measured
to cost that thread ~20% (competition for the interpreter), hence this split.

A caller whose thread mostly waits (vLLM's engine core: each step it blocks on the
workers' forward, the interpreter released) may instead take the snapshot itself and
hand it over (`submit`): this publisher's thread encodes and writes it, under the same
envelope, sequence, error accounting and lock as `publish()`. One snapshot is pending at
most (a newer one replaces one not yet written); `close()` drops a pending one (the file
is removed anyway), so a closed publisher leaves no thread, descriptor or file.

A failed publish is counted under one reason (`reason_of`: one of
`format.PUBLISH_ERROR_REASONS`, told from the errno and, for ENOSPC, the directory's
`statvfs`: no inode left with blocks free is `no_inodes`, EROFS `read_only`) and the last
one kept (`format.LastError`, its detail `detail_of` the exception and the filesystem's
free blocks and inodes); the counts ride in the envelope of every file it publishes, the
last error in the file that ends a run of failures (the first publish that works again,
not the ones after it), so a publisher that fails now and then, or that recovers, shows
what happened, and a cause that no longer holds is not shown as the current one.

The publisher's pid and `process_start` (field 22 of `/proc/PID/stat`: start time in
clock ticks since boot, `proc_stat`) ride in the envelope too: a reader on the same host
tells a publisher that exited (no such pid, or a zombie) or whose pid now belongs to
another process (a different start time) from a live one.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
import threading
import time

from accounting.ledger import Ledger
from accounting.snapfile.directory import (
    TEMP_GRACE_S,
    SnapshotDir,
    SnapshotDirError,
    out_of_inodes,
)
from accounting.snapfile.format import (
    MAX_DETAIL,
    PUBLISH_ERROR_REASONS,
    SUFFIX,
    Envelope,
    LastError,
    check_interval,
    check_source,
    counts_of,
    encode,
    source_id,
)
from accounting.snapshot import Snapshot

# The logger keeps the name it had when this module was `accounting.snapfile.publisher`:
# log filters and alerts select on it.
log = logging.getLogger("accounting.snapfile.publisher")
FAILURE_LOG_EVERY_S = 60.0  # a publisher that keeps failing logs one line a minute
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_PERMISSION = {errno.EACCES, errno.EPERM}
_ST_RDONLY = getattr(os, "ST_RDONLY", 1)
_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_STAT_MAX = 4096  # /proc/PID/stat is one line of a few hundred bytes


class Publisher:
    """Writes `ledger`'s snapshot to `directory` every `interval` seconds until closed.

    Use as a context manager or call `close()` (idempotent), which stops the thread
    and removes the file, so a clean shutdown leaves nothing for the exporter to serve.
    """

    def __init__(
        self,
        ledger: Ledger,
        directory: str | os.PathLike[str],
        *,
        interval: float = 1.0,
        source: str | None = None,
        group_writable: bool = False,
        fsync: bool = False,
        temp_grace: float = TEMP_GRACE_S,
    ) -> None:
        check_interval(interval, "Publisher: interval")
        self.ledger = ledger
        self.pid = os.getpid()
        self.source = check_source(source or source_id(ledger.labels, self.pid), "Publisher")
        self.interval = float(interval)
        self.fsync = fsync
        self._dir = SnapshotDir(directory, create=True, group_writable=group_writable)
        self.directory = self._dir.path
        self.name = self.source + SUFFIX
        self.path = os.path.join(self.directory, self.name)
        self._written: tuple[int, int] | None = None  # (st_dev, st_ino) of our file
        # An earlier publisher of this name killed mid-write left its temporary file.
        try:
            self.temporaries_removed = self._dir.remove_stale_temporaries(
                time.time(), temp_grace, final=self.name
            )
        except OSError as e:
            self.temporaries_removed = 0
            log.warning("publisher %s: removing stale temporary files: %s", self.source, e)
        self._host = socket.gethostname()
        self._process_start = process_start_ticks(self.pid)
        self.sequence = 0
        self.errors = 0
        self.errors_by_reason: dict[str, int] = dict.fromkeys(PUBLISH_ERROR_REASONS, 0)
        self.last_error: LastError | None = None
        self._failing = 0  # failures in a row
        self._failure_logged = 0.0
        self.last_snapshot: Snapshot | None = None
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        # `submit`: the snapshot waiting for this publisher's thread (None: none) with its
        # place in line (`_taken`: given when `submit` stores it, or right after `publish()`
        # takes its snapshot; none is written after one placed later), and the event that
        # wakes the thread.
        self._pending: tuple[int, Snapshot] | None = None
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._taken = itertools.count(1)
        self._last_written = 0
        self.submitted = 0  # snapshots handed over by `submit`
        self.replaced = 0  # of them, replaced by a newer one before the thread wrote them
        self._closed = False
        # Due time of the next publish (monotonic). While the engine allocates, the
        # allocating thread publishes when due (the ledger's event hook, checked every 64
        # events): no second thread competes with it for the interpreter. Seen in
        # `kvledger bench scrape`: a thread publishing beside a thread busy allocating took
        # 1 s of wall and ~200 ms of CPU for a 1 ms publish, and slowed the allocating
        # thread by ~20%. The thread below only covers an idle engine: it wakes one interval
        # after a publish was due and found none, so a busy engine's thread rarely wakes.
        self._next_due = time.monotonic()
        try:
            self._publish_safely()  # the first one here, on the caller's thread
        except BaseException:
            self._dir.close()
            raise
        ledger.set_event_hook(self._publish_if_due)
        self._thread = threading.Thread(
            target=self._run, name=f"kvledger-publisher-{self.source}", daemon=True
        )
        self._thread.start()

    # -- publishing -------------------------------------------------------------------
    def _publish_if_due(self) -> None:
        if time.monotonic() >= self._next_due and not self._closed:
            self._publish_safely()

    def _publish_safely(self, pending: tuple[int, Snapshot] | None = None) -> None:
        """Publish (`pending`: write that snapshot `submit` handed over); a failure is counted
        and logged, never raised (it must not fail an allocation, nor stop the thread); the
        next try is an interval later. The first
        failure of a run of them is logged with its traceback, the rest one line at most
        every `FAILURE_LOG_EVERY_S`, and the first success after them says so."""
        try:
            if pending is None:
                self.publish()
            else:
                self._write_submitted(*pending)
        except Exception as e:
            self.errors += 1
            self._failing += 1
            fs = self._statvfs() if isinstance(e, OSError) else None
            reason = reason_of(e, fs)
            self.errors_by_reason[reason] += 1
            self.last_error = LastError(reason, detail_of(e, fs), time.time())
            self._next_due = time.monotonic() + self.interval
            now = time.monotonic()
            if self._failing == 1:
                log.exception(
                    "publisher %s: publishing to %s failed; retrying", self.source, self.path
                )
                self._failure_logged = now
            elif now - self._failure_logged >= FAILURE_LOG_EVERY_S:
                log.warning(
                    "publisher %s: publishing to %s still failing (%d times in a row): %s: %s",
                    self.source,
                    self.path,
                    self._failing,
                    type(e).__name__,
                    " ".join(str(e).split()),
                )
                self._failure_logged = now
        else:
            if self._failing:
                log.info(
                    "publisher %s: publishing to %s again, after %d failures",
                    self.source,
                    self.path,
                    self._failing,
                )
                self._failing = 0

    def publish(self) -> Snapshot:
        """Take a snapshot and write it now."""
        self._next_due = time.monotonic() + self.interval
        snap = self.ledger.snapshot()
        self._write_snapshot(next(self._taken), snap)
        return snap

    def submit(self, snapshot: Snapshot | None = None) -> Snapshot:
        """Hand a snapshot to this publisher's thread, which encodes and writes it as
        `publish()` would; returns at once, having done no file I/O. `snapshot`: taken by the
        caller at the instant it wants published (None: `ledger.snapshot()` here, on the
        caller's thread). One waits at most: a newer one replaces one not yet written. A
        failed write is counted and logged by that thread, as a failed `publish()` is. After
        `close()` (or during it) nothing is kept: the snapshot is returned, never written."""
        snap = self.ledger.snapshot() if snapshot is None else snapshot
        if not isinstance(snap, Snapshot):
            raise TypeError(
                f"Publisher.submit: snapshot={snapshot!r}, expected an accounting.snapshot.Snapshot"
            )
        self._next_due = time.monotonic() + self.interval
        with self._pending_lock:
            if self._stop.is_set():
                return snap
            if self._pending is not None:
                self.replaced += 1
            self._pending = (next(self._taken), snap)
            self.submitted += 1
        self._wake.set()
        return snap

    def _take_pending(self) -> tuple[int, Snapshot] | None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        return pending

    def _write_submitted(self, order: int, snap: Snapshot) -> None:
        """On this publisher's thread: encode and write a snapshot `submit` handed over."""
        self._write_snapshot(order, snap)

    def _write_snapshot(self, order: int, snap: Snapshot) -> None:
        with self._write_lock:
            # Closed, or one placed after this one is already written (a `publish()` on
            # another thread overtook a submitted one): the file does not go back in time.
            if self._closed or order < self._last_written:
                return
            self._last_written = order
            self.sequence += 1
            envelope = Envelope(
                source=self.source,
                pid=self.pid,
                host=self._host,
                process_start=self._process_start,
                interval=self.interval,
                published_at=time.time(),
                sequence=self.sequence,
                publish_errors=counts_of(self.errors_by_reason),
                # The last error only in the publish that ends a run of failures: a file
                # published after that run carries no cause that no longer holds.
                last_error=self.last_error if self._failing else None,
            )
            self._write(encode(envelope, snap))
            self.last_snapshot = snap

    def _write(self, data: bytes) -> None:
        try:
            self._written = self._dir.write_replace(self.name, data, fsync=self.fsync)
        except FileNotFoundError:
            # The directory was removed under us (a tmp cleaner): open the path again, under
            # the same checks (a directory someone else created there is refused).
            if not self._dir.moved():
                raise
            self._dir.reopen()
            self._written = self._dir.write_replace(self.name, data, fsync=self.fsync)

    def _statvfs(self) -> os.statvfs_result | None:
        """The directory's filesystem now, or None when it cannot be read."""
        try:
            return os.fstatvfs(self._dir.fd)
        except (OSError, ValueError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            # A submitted snapshot first (checked after every wake: `submit` sets it, then
            # the event, so none waits for the next wake).
            pending = self._take_pending()
            if pending is not None:
                self._publish_safely(pending)
                continue
            # An allocating engine moves `_next_due` ahead itself; wake only when it is an
            # interval overdue, i.e. nothing has published for two intervals.
            wait = self._next_due + self.interval - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            self._publish_safely()

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop publishing and remove the file. Idempotent. A snapshot `submit` handed over
        and the thread has not started writing is dropped, never written (the file is
        removed next anyway); one being written is finished first, then removed."""
        if self._stop.is_set() and self._closed:
            return
        with self._pending_lock:
            self._stop.set()
            self._pending = None
        self._wake.set()
        self.ledger.clear_event_hook(self._publish_if_due)
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._write_lock:
            self._closed = True
            if self._written is not None and not self._dir.closed:
                with contextlib.suppress(OSError):
                    self._dir.remove_if(self.name, self._written)
            self._dir.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- why a publish failed ------------------------------------------------------------------------
def reason_of(e: BaseException, fs: os.statvfs_result | None = None) -> str:
    """The reason a publish failed with `e`; `fs`, the directory's `statvfs` read after the
    failure, tells an ENOSPC of no inode left (`no_inodes`) from one of no room."""
    if isinstance(e, SnapshotDirError):
        return "directory"
    if isinstance(e, OSError):
        if e.errno == errno.EROFS:
            return "read_only"
        if e.errno in _NO_SPACE:
            return "no_inodes" if fs is not None and out_of_inodes(fs) else "no_space"
        if e.errno in _PERMISSION:
            if fs is not None and fs.f_flag & _ST_RDONLY:
                return "read_only"  # a read-only mount some filesystems report as EACCES
            return "permission"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "directory"
    return "other"


def detail_of(e: BaseException, fs: os.statvfs_result | None = None) -> str:
    """`e` as one line of at most MAX_DETAIL characters; for a full filesystem (ENOSPC,
    EDQUOT) with `fs` the free bytes and inodes follow, so the line says which ran out."""
    text = " ".join(str(e).split()) or type(e).__name__
    line = f"{type(e).__name__}: {text}"
    if fs is not None and isinstance(e, OSError) and e.errno in _NO_SPACE:
        line = (
            f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}; "
            f"{fs.f_bavail * fs.f_frsize} bytes and {fs.f_favail} of {fs.f_files} inodes free"
        )
    return line[:MAX_DETAIL]


# -- the publishing process, as this host's kernel sees it ---------------------------------------
def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of `pid` from /proc, or None if absent."""
    # Read once per source per scan: os-level calls (open, read, close), not a buffered file
    # object (which adds an fstat, an ioctl and a second read).
    try:
        fd = os.open(f"/proc/{pid}/stat", _O_FLAGS)
    except OSError:
        return None
    try:
        stat = os.read(fd, _STAT_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) is in parentheses and may hold spaces; fields follow the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    st = proc_stat(pid)
    return st[1] if st else None
