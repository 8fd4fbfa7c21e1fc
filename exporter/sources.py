"""Where snapshots come from: a directory of published files, and ledgers in this process.

`Sources.read()` returns a `Scan`: one `SourceView` per source (its latest
snapshot's `Summary`, whether it is up, how old it is) together with what went
wrong reading them (the files refused, per-reason counts, in-process ledgers whose
snapshot failed), so whoever renders a scan needs nothing else. Which files are
read and how is the snapshot file's business (`accounting.snapfile.reader`:
checked directory, regular files of a trusted owner, size cap, one schema); a
file's first line (all a scrape reads) is parsed once per version (device, inode,
size, mtime), so a read costs a directory scan and one `lstat` per source; its
buffer rows are parsed when someone asks for the buffer map. Nothing a scrape
does costs O(buffers).

A source is down (`up` False, with `stale_reason`) when:
- its publisher stopped without closing: its heartbeat is older than the bound, or,
  on this host, its pid is gone (exited, a zombie, or reused by another process);
- it conflicts: two live sources carry the same engine labels (what an engine's
  metrics are keyed by). Neither is believed and both are listed with the reason,
  rather than one silently winning: a file that imitates an engine can then hide
  its figures (an alert fires) but never replace them.
- its directory became unusable (replaced by one the rules refuse): every source
  it served last is listed down with the directory's problem as the reason.
A down source carries its last publish error (`last_error`), the current cause only:
while no publisher can write in the directory (a read-only mount, no permission, no
inode left, no room: the scan's `write_problem`, `accounting.snapfile.reader`) that cause,
seen by the exporter, since a publisher that cannot write cannot say so; else its
publisher's last error from its latest file, unless that is a cause the exporter can see
(`DIRECTORY_REASONS`) and no longer does.
A source that is down because its process is gone on this host, while a live
source with the same engine labels has taken its place (a restart), is dropped
at once and its file removed. A down source without a successor stays listed
(its alert keeps firing) until `forget_after`; then, if its process is gone on this
host (killed without closing), its file is removed too, else it is only no longer
listed. The others are not affected. An
in-process ledger whose snapshot raises is left out of that read, logged by name
and counted (`exporter.failures`); the others are served.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.ledger import Ledger
from accounting.snapfile.directory import TEMP_GRACE_S
from accounting.snapfile.format import (
    DIRECTORY_REASONS,
    Envelope,
    LastError,
    Refused,
    source_id,
)
from accounting.snapfile.head import Head, buffer_map
from accounting.snapfile.reader import NO_SPACE_MIN_BYTES, FileScan, Ident, SnapshotFiles
from accounting.snapfile.summary import Summary, summary_of
from accounting.snapfile.writer import proc_stat
from accounting.snapshot import Snapshot
from exporter.failures import SourceFailures
from exporter.memory import release_free_memory
from exporter.metrics import EngineKey, engine_key

log = logging.getLogger(__name__)

# A heartbeat older than STALE_INTERVALS publish intervals (plus STALE_GRACE_S) marks a source
# stale when the exporter is given no explicit bound.
STALE_INTERVALS = 3.0
STALE_GRACE_S = 1.0
# The longest publish interval believed for staleness: a file claiming 3600 s would keep a
# dead source up for hours. A publisher slower than this needs --stale-after.
MAX_BELIEVED_INTERVAL_S = 60.0
SCAN_LOG_EVERY_S = 60.0  # a failing background scan's log line, at most this often
TRIM_AFTER_FILES = 256  # files gone from the directory before freed memory is given back


class BufferMapError(ValueError):
    """A source's buffer rows failed their checks (its metrics are still served)."""


_ENVELOPE_FIELDS = tuple(f.name for f in dataclasses.fields(Envelope))


@dataclass(frozen=True, kw_only=True)
class Published(Envelope):
    """One source's latest snapshot: its publisher's envelope and the snapshot's `Summary`.

    For a published file both come from the file's first line, checked
    (`accounting.snapfile.head.load`); the buffer rows are parsed and checked the first
    time someone asks for them (`buffer_map()`), once per file version. A failure there
    is that source's buffer map only (reported by `buffer_map()`, counted through
    `on_refused`), never its metrics.
    """

    summary: Summary
    path: str | None = None
    _head: Head | None = field(default=None, repr=False, compare=False)
    _on_refused: Callable[[str, Refused], None] | None = field(
        default=None, repr=False, compare=False
    )
    _lazy: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def from_file(
        cls, head: Head, path: str, on_refused: Callable[[str, Refused], None] | None = None
    ) -> Published:
        """A published file whose first line passed `accounting.snapfile.head.load`."""
        envelope = {name: getattr(head.envelope, name) for name in _ENVELOPE_FIELDS}
        return cls(**envelope, summary=head.summary, path=path, _head=head, _on_refused=on_refused)

    @classmethod
    def from_snapshot(
        cls, snap: Snapshot, *, source: str, pid: int, host: str, sequence: int
    ) -> Published:
        p = cls(
            source=source,
            pid=pid,
            host=host,
            process_start=None,
            interval=0.0,
            published_at=snap.taken_at,
            sequence=sequence,
            summary=summary_of(snap),
        )
        p._lazy["snapshot"] = snap
        return p

    def buffer_map(self) -> tuple[Snapshot | None, str | None]:
        """(the whole Snapshot, None), or (None, why) when the file's buffer rows failed
        their checks; parsed and checked once per file version."""
        with self._lock:
            if "snapshot" not in self._lazy and "error" not in self._lazy:
                assert self._head is not None
                try:
                    self._lazy["snapshot"] = buffer_map(self._head)
                except Exception as e:  # a Refused, or a bug: this buffer map only
                    if not isinstance(e, Refused):
                        log.exception("source %s: checking the buffer rows failed", self.source)
                        e = Refused("buffers", f"internal error: {type(e).__name__}: {e}")
                    self._lazy["error"] = e.detail
                    if self._on_refused is not None:
                        self._on_refused(self.path or self.source, e)
            return self._lazy.get("snapshot"), self._lazy.get("error")

    @property
    def snapshot(self) -> Snapshot:
        """The whole Snapshot; BufferMapError when the buffer rows failed."""
        snap, error = self.buffer_map()
        if snap is None:
            raise BufferMapError(f"source {self.source}: buffer map not served: {error}")
        return snap

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.summary.labels)

    @property
    def epoch(self) -> int:
        return self.summary.epoch

    @property
    def taken_at(self) -> float:
        return self.summary.taken_at


@dataclass(frozen=True)
class SourceView:
    """A source as seen at one read: its snapshot, liveness and age."""

    published: Published
    up: bool
    age_seconds: float  # now - snapshot.taken_at
    heartbeat_age_seconds: float  # now - published_at
    stale_reason: str | None
    # A down source's last publish error, the current cause only: what the exporter sees on
    # the directory (read_only, permission, no_inodes, no_space), else its publisher's.
    last_error: LastError | None = None

    @property
    def source(self) -> str:
        return self.published.source

    @property
    def snapshot(self) -> Snapshot:
        return self.published.snapshot

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.published.summary.labels)

    @property
    def summary(self) -> Summary:
        return self.published.summary


@dataclass(frozen=True)
class Scan:
    """One read of every source: the views, sorted by source, and what went wrong reading
    them, as of that read."""

    views: tuple[SourceView, ...] = ()
    files: FileScan[Published] = field(default_factory=FileScan)  # the directory's scan
    source_errors: Mapping[str, int] = field(default_factory=dict)  # ledgers left out so far
    # Client connections the server closed, by reason (`exporter.server.connections`); empty when
    # the exporter runs inside another server.
    connections_closed: Mapping[str, int] = field(default_factory=dict)


class Sources:
    """Snapshots from `directory` (files written by `accounting.snapfile.writer`'s
    `Publisher`) and from ledgers added with `add_ledger` (an engine that runs the exporter
    in-process).

    `stale_after`: seconds a heartbeat may age before its source is stale; None means
    STALE_INTERVALS publish intervals (at most MAX_BELIEVED_INTERVAL_S each) plus
    STALE_GRACE_S, per source.
    `forget_after`: seconds after which a stale source is no longer listed; its file is
    removed then when its pid is gone on this host, else left alone. None keeps listing it
    while its file exists.
    `create`: create the directory (0700) when missing; `group_writable`: accept a
    group-writable directory and files of its group (`accounting.snapfile.directory`). An
    existing directory that breaks the rules raises `SnapshotDirError` from there.
    `temp_grace`: seconds after which a temporary file of a writer that is gone is removed
    (`accounting.snapfile.directory.SnapshotDir.remove_stale_temporaries`).
    `close()` (idempotent) closes the directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        stale_after: float | None = None,
        forget_after: float | None = None,
        clock: Callable[[], float] = time.time,
        create: bool = False,
        group_writable: bool = False,
        temp_grace: float = TEMP_GRACE_S,
    ) -> None:
        for name, value in (("stale_after", stale_after), ("forget_after", forget_after)):
            if value is not None and not (
                isinstance(value, (int, float)) and 0 < value < float("inf")
            ):
                raise ValueError(
                    f"Sources: {name}={value!r}, expected a positive finite number of seconds"
                )
        self.stale_after = stale_after
        self.forget_after = forget_after
        self._clock = clock
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._ledgers: dict[str, Ledger] = {}
        self.files: SnapshotFiles[Published] | None = None
        if directory is not None:
            self.files = SnapshotFiles(
                directory,
                self._published,
                create=create,
                group_writable=group_writable,
                temp_grace=temp_grace,
            )
        self.directory = self.files.path if self.files is not None else None
        self.removed = 0  # files of dead sources removed (succeeded by a restart, or forgotten)
        self._known: dict[str, Published] = {}  # file sources of the last usable scan
        # What the HTTP server closed, by reason (`kvledger serve` sets it to its
        # `exporter.server.connections.ConnectionGuard`'s counts); read with each scan.
        self.connection_counts: Callable[[], Mapping[str, int]] | None = None
        # True when many client connections have gone since the last time (the server's
        # guard): their freed heap is given back as after many files
        self.connections_gone: Callable[[], bool] | None = None
        self._forgotten_trimmed = 0
        self._trims_due = 0
        self._failures = SourceFailures(("snapshot",), log)
        self._stop = threading.Event()
        self._scanner: threading.Thread | None = None
        self._keep_young = 0.0  # the scan interval while scanning in the background
        # Called with each background scan, in the scanning thread (`exporter.app` renders
        # there the scrape formats asked for, so a scrape finds each source's lines built).
        self.after_scan: Callable[[Scan], object] | None = None

    def _published(self, head: Head, path: str) -> Published:
        assert self.files is not None
        return Published.from_file(head, path, self.files.count)

    def add_ledger(self, ledger: Ledger, source: str | None = None) -> str:
        """Serve `ledger` directly, snapshotted at each read. Returns its source id."""
        name = source or source_id(ledger.labels, os.getpid())
        with self._lock:
            if name in self._ledgers:
                raise ValueError(f"add_ledger: source {name!r} is already added")
            self._ledgers[name] = ledger
        return name

    def remove_ledger(self, source: str) -> None:
        with self._lock:
            if self._ledgers.pop(source, None) is None:
                raise ValueError(f"remove_ledger: no in-process source {source!r}")

    # -- reading ---------------------------------------------------------------------------
    def read(self) -> Scan:
        """Every source's latest snapshot, sorted by source id, with what went wrong.

        While the background scan runs with a `max_age` (`start_scanning`), a file that
        changed since it was last parsed, less than `max_age` ago, is served in that version:
        the next background scan parses it. A request's read then costs a directory listing
        and an `lstat` per file however fast the ranks publish; a new source, and one not
        parsed for `max_age`, are parsed at once."""
        return self._read(self._keep_young)

    def _read(self, keep_young: float) -> Scan:
        with self._lock:
            now = self._clock()
            files: FileScan[Published] = (
                self.files.scan(now, keep_young) if self.files is not None else FileScan()
            )
            published = [f.value for f in files.served]
            unusable = self._keep_known(files)
            for name, ledger in self._ledgers.items():
                try:
                    snap = ledger.snapshot()
                    published.append(
                        Published.from_snapshot(
                            snap, source=name, pid=os.getpid(), host=self._host, sequence=snap.epoch
                        )
                    )
                except Exception as e:  # this ledger only; the others are served
                    self._failures.failed("snapshot", name, e)
            now = self._clock()
            views = [self._view(p, now) for p in published]
            views += [
                SourceView(p, False, max(0.0, now - p.taken_at), max(0.0, now - p.published_at), r)
                for p, r in unusable
            ]
            idents = {f.value.source: (f.name, f.ident) for f in files.served}
            views = self._settle(views, idents)
            views = self._with_last_errors(views, idents, files, now)
            source_errors = dict(self._failures.counts)
        if self.forget_after is not None:
            limit = self.forget_after
            views = [v for v in views if v.up or v.heartbeat_age_seconds <= limit]
        views.sort(key=lambda v: v.source)
        self._release_memory()
        closed = dict(self.connection_counts()) if self.connection_counts is not None else {}
        return Scan(tuple(views), files, source_errors, closed)

    def _release_memory(self) -> None:
        """After many files are gone (TRIM_AFTER_FILES forgotten since the last time), or
        many client connections (`connections_gone`), give the freed heap back to the OS, at
        this read and the next (by then a render has dropped its own caches of them), so RSS
        does not stay at its peak."""
        if self.connections_gone is not None and self.connections_gone():
            self._trims_due = 2
        files = self.files
        if files is not None and files.forgotten - self._forgotten_trimmed >= TRIM_AFTER_FILES:
            self._forgotten_trimmed = files.forgotten
            self._trims_due = 2
        if self._trims_due:
            self._trims_due -= 1
            release_free_memory()

    def _keep_known(self, files: FileScan[Published]) -> list[tuple[Published, str]]:
        """While the directory is usable, remember the sources it serves; while it is not
        (replaced by one the rules refuse, unreadable), every source it served last is
        listed down with the reason, until `forget_after`, rather than vanishing."""
        if files.directory_problem is None:
            self._known = {f.value.source: f.value for f in files.served}
            return []
        reason = f"snapshot directory not usable: {files.directory_problem}"
        return [(p, reason) for p in self._known.values()]

    def _with_last_errors(
        self,
        views: list[SourceView],
        idents: dict[str, tuple[str, Ident]],
        files: FileScan[Published],
        now: float,
    ) -> list[SourceView]:
        """Each down source with its last publish error, the current cause only: the
        directory's, while no publisher can write there (`files.write_problem`: read_only,
        permission, no_inodes, no_space, seen by the exporter, since a publisher that cannot
        write cannot say so), or no_space when the filesystem has no room for this source's
        file; else its publisher's own last error from the file, unless that is a cause the
        exporter looks for (`DIRECTORY_REASONS`) and no longer finds."""
        if all(v.up for v in views):
            return views
        looked = self.files is not None and files.directory_problem is None
        free = self.files.free_bytes() if looked and self.files is not None else None
        # What the exporter's look decides: permission only where this user's access tells
        # the publishers' (its own directory, no group mode).
        seen = {
            r
            for r in DIRECTORY_REASONS
            if looked and (r != "permission" or (self.files and self.files.permission_checked))
        }
        out = []
        for v in views:
            if not v.up:
                last = v.published.last_error
                if last is not None and last.reason in seen:
                    last = None  # the exporter looked: that cause no longer holds
                size = idents[v.source][1][2] if v.source in idents else 0
                problem = files.write_problem
                if problem is not None:
                    last = LastError(problem.reason, problem.detail, now)
                elif free is not None and free < max(size, NO_SPACE_MIN_BYTES):
                    last = LastError(
                        "no_space",
                        f"the snapshot directory's filesystem has {free} bytes free, less than "
                        f"this source's file needs ({size} bytes): its publisher cannot write",
                        now,
                    )
                if last is not None:
                    v = dataclasses.replace(v, last_error=last)
            out.append(v)
        return out

    def _settle(
        self, views: list[SourceView], idents: dict[str, tuple[str, Ident]]
    ) -> list[SourceView]:
        """Conflicts and successions between sources with the same engine labels."""
        groups: dict[EngineKey, list[SourceView]] = {}
        for v in views:
            groups.setdefault(engine_key(v.labels), []).append(v)
        out: list[SourceView] = []
        for key, group in groups.items():
            live = [v for v in group if v.up]
            for v in group:
                if v.up and len(live) > 1:
                    others = ", ".join(o.source for o in live if o is not v)
                    reason = (
                        f"conflict: {others} carries the same engine labels {dict(key)}; "
                        "neither is exported"
                    )
                    out.append(
                        SourceView(
                            v.published, False, v.age_seconds, v.heartbeat_age_seconds, reason
                        )
                    )
                elif not v.up and v.published.pid is not None and self._gone(v):
                    if live:
                        self._remove(v, idents.get(v.source), "a live source has its engine labels")
                    elif self.forget_after is not None and (
                        v.heartbeat_age_seconds > self.forget_after
                    ):
                        # Killed without closing (vLLM's shutdown SIGKILLs its engine core and
                        # workers) and forgotten: its file would otherwise stay forever.
                        self._remove(v, idents.get(v.source), "it is forgotten")
                    else:
                        out.append(v)
                else:
                    out.append(v)
        return out

    def _gone(self, v: SourceView) -> bool:
        return v.published.host == self._host and self._pid_gone(v.published) is not None

    def _remove(self, v: SourceView, ident: tuple[str, Ident] | None, why: str) -> None:
        if ident is None or self.files is None:
            return
        if self.files.remove(*ident):
            self.removed += 1
            log.info(
                "source %s: pid %s is gone and %s; removed %s",
                v.source,
                v.published.pid,
                why,
                v.published.path,
            )

    # -- liveness -----------------------------------------------------------------------------
    def _view(self, p: Published, now: float) -> SourceView:
        heartbeat_age = max(0.0, now - p.published_at)
        age = max(0.0, now - p.taken_at)
        reason = None
        if p.interval > 0:  # a published file (in-process ledgers are read live)
            bound = (
                self.stale_after
                if self.stale_after is not None
                else STALE_INTERVALS * min(p.interval, MAX_BELIEVED_INTERVAL_S) + STALE_GRACE_S
            )
            reason = self._pid_gone(p)
            if reason is None and heartbeat_age > bound:
                reason = f"heartbeat is {heartbeat_age:.1f} s old, over the bound of {bound:.1f} s"
        return SourceView(p, reason is None, age, heartbeat_age, reason)

    def _pid_gone(self, p: Published) -> str | None:
        if p.pid is None or p.host != self._host:
            return None  # another host: only the heartbeat can tell
        st = proc_stat(p.pid)
        if st is None:
            if os.path.isdir("/proc/self"):
                return f"pid {p.pid} has exited"
            return None
        state, start = st
        if state in ("Z", "X"):
            return f"pid {p.pid} has exited (state {state})"
        if p.process_start is not None and start != p.process_start:
            return f"pid {p.pid} now belongs to another process"
        return None

    # -- scanning ahead of requests ------------------------------------------------------------
    def start_scanning(self, interval: float, max_age: float = 0.0) -> None:
        """Read every `interval` seconds in a thread of its own, so a file's first line is
        parsed and checked as it is published rather than when a scrape arrives (a scrape
        then finds it parsed). `max_age` (s): a request's read keeps serving a changed file's
        version parsed less than that long ago (the next background scan parses the new one),
        so its cost no longer grows with how fast the ranks publish; 0 (the default): a
        request parses whatever changed, and serves every file as it is now. Stopped by
        `close()`."""
        if not 0 < interval < float("inf"):
            raise ValueError(f"start_scanning: interval={interval!r}, expected seconds > 0")
        if not 0 <= max_age < float("inf"):
            raise ValueError(f"start_scanning: max_age={max_age!r}, expected seconds >= 0")
        if self._scanner is not None:
            raise RuntimeError("start_scanning: already scanning")
        self._scanner = threading.Thread(
            target=self._scan_loop, args=(interval,), name="kvledger-scan", daemon=True
        )
        self._keep_young = max_age
        self._scanner.start()

    def _scan_loop(self, interval: float) -> None:
        logged, held = -SCAN_LOG_EVERY_S, 0
        while not self._stop.wait(interval):
            try:
                scan = self._read(0.0)
                if self.after_scan is not None:
                    self.after_scan(scan)
            except Exception as e:  # a bug, or the OS (EMFILE): the scanning goes on
                now = time.monotonic()
                if now - logged < SCAN_LOG_EVERY_S:
                    held += 1
                    continue
                more = f" ({held} more since the last line)" if held else ""
                log.error(
                    "background scan of %s failed%s; retrying every %g s: %s: %s",
                    self.directory,
                    more,
                    interval,
                    type(e).__name__,
                    e,
                    exc_info=e if logged < 0 else None,
                )
                logged, held = now, 0

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        if self._scanner is not None and self._scanner is not threading.current_thread():
            self._scanner.join()
            self._scanner = None
        if self.files is not None:
            self.files.close()

    def __enter__(self) -> Sources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
