"""Where snapshots come from: a directory of published files, and ledgers in this process.

`Sources.read()` returns one `SourceView` per source: its latest snapshot, whether
it is up, and how old it is. Files are written whole and renamed into place by
`accounting.publisher`, so a file read here is never torn. A parsed file is cached
by its identity (device, inode, size, mtime), so a read costs a directory scan and
one `stat` per source; a file is parsed again only after its publisher replaced
it, and then only its first line (O(families + accounts)); the buffer rows are
parsed when the debug endpoint asks for them. Nothing costs O(slots).

A source is stale (`up` False) when its publisher stopped without closing: its
heartbeat (`published_at`) is older than the bound, or, on this host, its pid is
gone (exited, a zombie, or reused by another process). A stale source keeps being
listed, its age growing, until its file is removed; the others are not affected.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from accounting.ledger import Ledger
from accounting.publisher import SUFFIX, parse, proc_stat, snapshot_of, source_id
from accounting.snapshot import Snapshot

log = logging.getLogger(__name__)

# A heartbeat older than STALE_INTERVALS publish intervals (plus STALE_GRACE_S) marks a source
# stale when the exporter is given no explicit bound.
STALE_INTERVALS = 3.0
STALE_GRACE_S = 1.0


@dataclass(frozen=True)
class Published:
    """One source's latest snapshot with its publisher's heartbeat.

    `summary` is `Snapshot.to_dict()` without the buffer rows: all a scrape reads.
    `snapshot` (the whole Snapshot, buffer rows included) is built on first use.
    """

    source: str
    pid: int | None
    host: str | None
    process_start: int | None
    interval: float  # 0 for an in-process ledger (read at scrape time)
    published_at: float
    sequence: int
    summary: dict[str, Any]
    path: str | None = None
    _rows: bytes | None = field(default=None, repr=False, compare=False)
    _lazy: dict[str, Snapshot] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_file_bytes(cls, data: bytes, path: str | None = None) -> Published:
        envelope, rows = parse(data)
        summary = envelope["snapshot"]
        for key in ("epoch", "taken_at", "labels", "totals", "families", "accounts"):
            if key not in summary:
                raise ValueError(f"snapshot lacks {key!r}")
        return cls(
            source=str(envelope["source"]),
            pid=envelope.get("pid"),
            host=envelope.get("host"),
            process_start=envelope.get("process_start"),
            interval=float(envelope["interval"]),
            published_at=float(envelope["published_at"]),
            sequence=int(envelope["sequence"]),
            summary=summary,
            path=path,
            _rows=rows,
        )

    @classmethod
    def from_snapshot(
        cls, snap: Snapshot, *, source: str, pid: int, host: str, sequence: int
    ) -> Published:
        summary = snap.to_dict()
        del summary["buffers"]
        p = cls(
            source=source,
            pid=pid,
            host=host,
            process_start=None,
            interval=0.0,
            published_at=snap.taken_at,
            sequence=sequence,
            summary=summary,
        )
        p._lazy["snapshot"] = snap
        return p

    @property
    def snapshot(self) -> Snapshot:
        snap = self._lazy.get("snapshot")
        if snap is None:
            assert self._rows is not None
            snap = snapshot_of({"snapshot": self.summary}, self._rows)
            self._lazy["snapshot"] = snap
        return snap

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.summary["labels"])

    @property
    def epoch(self) -> int:
        return int(self.summary["epoch"])

    @property
    def taken_at(self) -> float:
        return float(self.summary["taken_at"])


@dataclass(frozen=True)
class SourceView:
    """A source as seen at one read: its snapshot, liveness and age."""

    published: Published
    up: bool
    age_seconds: float  # now - snapshot.taken_at
    heartbeat_age_seconds: float  # now - published_at
    stale_reason: str | None

    @property
    def source(self) -> str:
        return self.published.source

    @property
    def snapshot(self) -> Snapshot:
        return self.published.snapshot

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.published.summary["labels"])

    @property
    def summary(self) -> dict[str, Any]:
        return self.published.summary


class Sources:
    """Snapshots from `directory` (files written by `accounting.publisher.Publisher`) and from
    ledgers added with `add_ledger` (an engine that runs the exporter in-process).

    `stale_after`: seconds a heartbeat may age before its source is stale; None means
    STALE_INTERVALS publish intervals plus STALE_GRACE_S, per source.
    `forget_after`: seconds after which a stale source is no longer listed (its file is
    left alone); None keeps listing it while its file exists.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        stale_after: float | None = None,
        forget_after: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (("stale_after", stale_after), ("forget_after", forget_after)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"Sources: {name}={value!r}, expected a positive number of seconds"
                )
        self.directory = os.fspath(directory) if directory is not None else None
        self.stale_after = stale_after
        self.forget_after = forget_after
        self._clock = clock
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, int, int, int], Published]] = {}
        self._ledgers: dict[str, Ledger] = {}
        self.unreadable: dict[str, str] = {}  # path -> why, for files that are not snapshots
        self.parses = 0  # files parsed so far (a cache miss each)

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
    def read(self) -> list[SourceView]:
        """Every source's latest snapshot, sorted by source id."""
        with self._lock:
            published = self._scan() if self.directory is not None else []
            for name, ledger in self._ledgers.items():
                snap = ledger.snapshot()
                published.append(
                    Published.from_snapshot(
                        snap, source=name, pid=os.getpid(), host=self._host, sequence=snap.epoch
                    )
                )
            now = self._clock()
            views = [self._view(p, now) for p in published]
        if self.forget_after is not None:
            limit = self.forget_after
            views = [v for v in views if v.up or v.heartbeat_age_seconds <= limit]
        views.sort(key=lambda v: v.source)
        return views

    def _scan(self) -> list[Published]:
        assert self.directory is not None
        out: list[Published] = []
        seen: set[str] = set()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
                continue  # temporaries of a write in progress, foreign files
            path = entry.path
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # removed by a publisher closing since the scan
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._cache.get(path)
            if cached is None or cached[0] != ident:
                loaded = self._load(path)
                if loaded is None:
                    continue
                cached = loaded
                self._cache[path] = cached
            seen.add(path)
            out.append(cached[1])
        for path in set(self._cache) - seen:
            del self._cache[path]
        for path in set(self.unreadable) - {e.path for e in entries}:
            del self.unreadable[path]
        return out

    def _load(self, path: str) -> tuple[tuple[int, int, int, int], Published] | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._unreadable(path, f"cannot read: {e}")
            return None
        self.parses += 1
        try:
            published = Published.from_file_bytes(data, path)
        except (ValueError, KeyError, TypeError) as e:
            self._unreadable(path, f"not a kvledger snapshot: {type(e).__name__}: {e}")
            return None
        self.unreadable.pop(path, None)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), published

    def _unreadable(self, path: str, why: str) -> None:
        if self.unreadable.get(path) != why:
            log.warning("snapshot file %s skipped: %s", path, why)
        self.unreadable[path] = why

    # -- liveness -----------------------------------------------------------------------------
    def _view(self, p: Published, now: float) -> SourceView:
        heartbeat_age = max(0.0, now - p.published_at)
        age = max(0.0, now - p.taken_at)
        reason = None
        if p.interval > 0:  # a published file (in-process ledgers are read live)
            bound = (
                self.stale_after
                if self.stale_after is not None
                else STALE_INTERVALS * p.interval + STALE_GRACE_S
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
