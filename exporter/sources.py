"""Where snapshots come from: a directory of published files, and ledgers in this process.

`Sources.read()` returns one `SourceView` per source: its latest snapshot, whether
it is up, and how old it is. Which files are read and how is
`exporter.snapfiles`' business (checked directory, regular files of a trusted
owner, size cap, one schema: `exporter.validate`); a file is parsed once per
version (device, inode, size, mtime), so a read costs a directory scan and one
`lstat` per source. Nothing costs O(slots).

A source is down (`up` False, with `stale_reason`) when:
- its publisher stopped without closing: its heartbeat is older than the bound, or,
  on this host, its pid is gone (exited, a zombie, or reused by another process);
- it conflicts: two live sources carry the same engine labels (what an engine's
  metrics are keyed by). Neither is believed and both are listed with the reason,
  rather than one silently winning: a file that imitates an engine can then hide
  its figures (an alert fires) but never replace them.
A source that is down because its process is gone on this host, while a live
source with the same engine labels has taken its place (a restart), is dropped
at once and its file removed. A down source without a successor stays listed
(its alert keeps firing) until `forget_after`; the others are not affected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from accounting.figures import FIGURE_NAMES
from accounting.ledger import Ledger
from accounting.publisher import proc_stat, source_id
from accounting.snapshot import SCHEMA_VERSION, AccountRow, Snapshot
from exporter import metrics as m
from exporter.snapfiles import FileProblem, Ident, SnapshotFiles

log = logging.getLogger(__name__)

# A heartbeat older than STALE_INTERVALS publish intervals (plus STALE_GRACE_S) marks a source
# stale when the exporter is given no explicit bound.
STALE_INTERVALS = 3.0
STALE_GRACE_S = 1.0


_ACCOUNT_FIELDS = tuple(f.name for f in dataclasses.fields(AccountRow))


def _account_dict(a: AccountRow) -> dict[str, Any]:
    """`AccountRow.to_dict()` without `dataclasses.asdict`'s deep copy (4x faster)."""
    d = {k: getattr(a, k) for k in _ACCOUNT_FIELDS}
    d["owner"] = a.owner.value
    d["map_bucket_counts"] = list(a.map_bucket_counts)
    return d


def summary_of(snap: Snapshot) -> dict[str, Any]:
    """`snap.to_dict()` without the buffer rows (and without building them): all a scrape
    reads. The totals are the sum of the per-family rollup."""
    families = snap.rollup("family", "owner")
    totals = dict.fromkeys(FIGURE_NAMES, 0)
    for figs in families.values():
        for name, value in figs.items():
            totals[name] += value
    return {
        "schema": SCHEMA_VERSION,
        "epoch": snap.epoch,
        "taken_at": snap.taken_at,
        "labels": dict(snap.labels),
        "totals": totals,
        "families": [
            {"family": fam, "owner": own, **figs} for (fam, own), figs in sorted(families.items())
        ],
        "accounts": [_account_dict(a) for a in snap.accounts],
        "violations": [v.to_dict() for v in snap.violations],
        "reconciliation": [dict(r) for r in snap.reconciliation],
        "tp": snap.tp.to_dict() if snap.tp is not None else None,
    }


@dataclass(frozen=True)
class Published:
    """One source's latest snapshot with its publisher's heartbeat.

    `summary` is `Snapshot.to_dict()` without the buffer rows: all a scrape reads.
    `snapshot` is the whole Snapshot, buffer rows included.
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
    _lazy: dict[str, Snapshot] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_file(cls, envelope: dict[str, Any], snap: Snapshot, path: str) -> Published:
        """A published file that passed `exporter.validate` (figures recomputed there)."""
        p = cls(summary=summary_of(snap), path=path, **envelope)
        p._lazy["snapshot"] = snap
        return p

    @classmethod
    def from_snapshot(
        cls, snap: Snapshot, *, source: str, pid: int, host: str, sequence: int
    ) -> Published:
        summary = summary_of(snap)
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
        return self._lazy["snapshot"]

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


def engine_key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The engine labels a source's metrics carry (defaults filled in): two live sources
    with the same key would export the same series."""
    out = {k: str(labels.get(k) or m.ENGINE_LABEL_DEFAULTS[k]) for k in m.ENGINE_LABELS}
    for k in m.OPTIONAL_ENGINE_LABELS:
        if labels.get(k) not in (None, ""):
            out[k] = str(labels[k])
    return tuple(sorted(out.items()))


class Sources:
    """Snapshots from `directory` (files written by `accounting.publisher.Publisher`) and from
    ledgers added with `add_ledger` (an engine that runs the exporter in-process).

    `stale_after`: seconds a heartbeat may age before its source is stale; None means
    STALE_INTERVALS publish intervals plus STALE_GRACE_S, per source.
    `forget_after`: seconds after which a stale source is no longer listed (its file is
    left alone); None keeps listing it while its file exists.
    `create`: create the directory (0700) when missing; `group_writable`: accept a
    group-writable directory and files of its group (`accounting.snapdir`). An existing
    directory that breaks the rules raises `accounting.snapdir.SnapshotDirError`.
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
                directory, Published.from_file, create=create, group_writable=group_writable
            )
        self.directory = self.files.path if self.files is not None else None
        self.removed = 0  # files of dead sources removed after a restart took their place
        self._stop = threading.Event()
        self._scanner: threading.Thread | None = None

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

    # -- what went wrong with files -----------------------------------------------------------
    @property
    def unreadable(self) -> dict[str, str]:
        """path -> why, for every file in the directory that is not served."""
        if self.files is None:
            return {}
        return {
            os.path.join(self.files.path, p.name): f"{p.reason}: {p.detail}"
            for p in list(self.files.problems.values())
        }

    def problems(self) -> list[FileProblem]:
        """The directory's and its files' problems, as /debug/kv lists them (bounded)."""
        return self.files.shown_problems() if self.files is not None else []

    @property
    def error_counts(self) -> dict[str, int]:
        """Files refused so far, per reason (each version of a file counted once)."""
        return dict(self.files.error_counts) if self.files is not None else {}

    @property
    def parses(self) -> int:
        return self.files.parses if self.files is not None else 0

    # -- reading ---------------------------------------------------------------------------
    def read(self) -> list[SourceView]:
        """Every source's latest snapshot, sorted by source id."""
        with self._lock:
            now = self._clock()
            files = self.files.scan(now) if self.files is not None else []
            published = [p for _, _, p in files]
            for name, ledger in self._ledgers.items():
                snap = ledger.snapshot()
                published.append(
                    Published.from_snapshot(
                        snap, source=name, pid=os.getpid(), host=self._host, sequence=snap.epoch
                    )
                )
            now = self._clock()
            views = [self._view(p, now) for p in published]
            idents = {p.source: (name, ident) for name, ident, p in files}
            views = self._settle(views, idents)
        if self.forget_after is not None:
            limit = self.forget_after
            views = [v for v in views if v.up or v.heartbeat_age_seconds <= limit]
        views.sort(key=lambda v: v.source)
        return views

    def _settle(
        self, views: list[SourceView], idents: dict[str, tuple[str, Ident]]
    ) -> list[SourceView]:
        """Conflicts and successions between sources with the same engine labels."""
        groups: dict[tuple[tuple[str, str], ...], list[SourceView]] = {}
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
                elif not v.up and live and v.published.pid is not None and self._gone(v):
                    self._remove(v, idents.get(v.source))
                else:
                    out.append(v)
        return out

    def _gone(self, v: SourceView) -> bool:
        return v.published.host == self._host and self._pid_gone(v.published) is not None

    def _remove(self, v: SourceView, ident: tuple[str, Ident] | None) -> None:
        if ident is None or self.files is None:
            return
        if self.files.remove(*ident):
            self.removed += 1
            log.info(
                "source %s: pid %s is gone and a live source has its engine labels; removed %s",
                v.source,
                v.published.pid,
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

    # -- scanning ahead of requests ------------------------------------------------------------
    def start_scanning(self, interval: float) -> None:
        """Read every `interval` seconds in a thread of its own, so files are parsed and
        validated as they are published rather than when a scrape arrives (a DeepSeek-V4
        rank's file costs ~2-4 ms to validate; a scrape then finds them parsed). Stopped
        by `close()`."""
        if not 0 < interval < float("inf"):
            raise ValueError(f"start_scanning: interval={interval!r}, expected seconds > 0")
        if self._scanner is not None:
            raise RuntimeError("start_scanning: already scanning")
        self._scanner = threading.Thread(
            target=self._scan_loop, args=(interval,), name="kvledger-scan", daemon=True
        )
        self._scanner.start()

    def _scan_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.read()
            except Exception:  # a bug must not end the scanning; every read logs its own
                log.exception("background scan of %s failed", self.directory)

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
