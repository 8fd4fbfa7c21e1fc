"""Publish ledger snapshots to a directory, one file per source, for an exporter in another process.

Every `interval` seconds a `Publisher` takes `ledger.snapshot()` and writes it,
wrapped in a heartbeat envelope, to `<directory>/<source>.json`. The directory is
opened once and checked (`accounting.snapdir`: ours or root's, not writable by
others, created 0700); each file is written whole to a new file under an
unpredictable name (O_CREAT | O_EXCL | O_NOFOLLOW) and renamed over the old one,
all relative to the directory's descriptor, so a reader sees either the previous
file or the next, never a torn one, and a planted link is never followed.
`close()` removes the file only if it is still the one this publisher wrote.

Who publishes: while the engine allocates, the allocating thread itself, when a
publish is due (the ledger's event hook checks a monotonic deadline every 64
events: O(1), and one snapshot of O(buffers) per interval, never O(slots)). A
thread of its own covers an idle engine, waking only when a publish is an interval
overdue. A second thread publishing beside a busy allocating thread was measured
to cost that thread ~20% (competition for the interpreter), hence this split.

The file is two JSON documents, one per line (`ENVELOPE_SCHEMA`):

    {"kvledger_publish": 1, "source": str, "pid": int, "host": str,
     "process_start": int | null, "interval": float, "published_at": float,
     "sequence": int, "snapshot": Snapshot.to_dict() without "buffers"}
    [Snapshot.to_dict()["buffers"]...]

The first line carries everything a scrape needs (totals, per-family rollups,
accounts, relation violations, reconciliation) and parses in O(families +
accounts); the buffer rows on the second line are parsed only when someone asks
for the buffer map (`parse`, `snapshot_of`).

`published_at` is the heartbeat: it advances every interval even when no figure
moved, so a reader tells a dead or hung publisher (heartbeat older than a bound,
or its pid gone) from an idle one. `process_start` (the kernel's start time of
the process, in clock ticks) tells a reused pid from the original one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from accounting.ledger import Ledger
from accounting.snapdir import SnapshotDir
from accounting.snapshot import Snapshot

log = logging.getLogger(__name__)

ENVELOPE_SCHEMA = 1
SUFFIX = ".json"
# Publish intervals a publisher accepts and a reader believes (seconds).
MIN_INTERVAL_S = 0.01
MAX_INTERVAL_S = 3600.0
# Labels that name a source, in this order, when present in the ledger's labels.
SOURCE_LABELS = ("model_name", "engine_type", "dp_rank", "pp_rank", "tp_rank", "moe_ep_rank")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def check_interval(value: object, what: str) -> float:
    """`value` as seconds between publishes: a finite number in [MIN_INTERVAL_S,
    MAX_INTERVAL_S], else ValueError naming `what`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S
    ):
        raise ValueError(
            f"{what}={value!r}, expected a number of seconds in "
            f"[{MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}]"
        )
    return float(value)


def source_id(labels: Mapping[str, str], pid: int) -> str:
    """A file-name-safe id from the engine labels and the pid, e.g. `dsv4-tp0-pp0-pid4242`."""
    parts = []
    for name in SOURCE_LABELS:
        value = labels.get(name)
        if value is None or value == "":
            continue
        short = {"tp_rank": "tp", "pp_rank": "pp", "dp_rank": "dp", "moe_ep_rank": "ep"}.get(name)
        parts.append(f"{short}{value}" if short else str(value))
    parts.append(f"pid{pid}")
    return _UNSAFE.sub("_", "-".join(parts)).strip("._-") or f"pid{pid}"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of `pid` from /proc, or None if absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
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


def encode(envelope: dict[str, Any]) -> bytes:
    """The file's bytes: the envelope without the buffer rows, a newline, the buffer rows."""
    snap = dict(envelope["snapshot"])
    buffers = snap.pop("buffers")
    head = json.dumps({**envelope, "snapshot": snap}, separators=(",", ":"))
    return head.encode() + b"\n" + json.dumps(buffers, separators=(",", ":")).encode()


def parse(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(envelope without buffer rows, the buffer rows' raw JSON) of a published file."""
    head, sep, rows = data.partition(b"\n")
    if not sep:
        raise ValueError("published file has one line, expected the envelope then the buffer rows")
    envelope = json.loads(head)
    if not isinstance(envelope, dict) or envelope.get("kvledger_publish") != ENVELOPE_SCHEMA:
        got = envelope.get("kvledger_publish") if isinstance(envelope, dict) else type(envelope)
        raise ValueError(f"kvledger_publish={got!r}, expected {ENVELOPE_SCHEMA}")
    return envelope, rows


def snapshot_of(envelope: dict[str, Any], rows: bytes) -> Snapshot:
    """The whole Snapshot of a published file (parses the buffer rows)."""
    return Snapshot.from_dict({**envelope["snapshot"], "buffers": json.loads(rows)})


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
    ) -> None:
        check_interval(interval, "Publisher: interval")
        self.ledger = ledger
        self.pid = os.getpid()
        self.source = source or source_id(ledger.labels, self.pid)
        if _UNSAFE.search(self.source) or self.source.startswith("."):
            raise ValueError(
                f"Publisher: source={self.source!r}, expected letters, digits, '_', '.', '-' "
                "and no leading '.'"
            )
        self.interval = float(interval)
        self.fsync = fsync
        self._dir = SnapshotDir(directory, create=True, group_writable=group_writable)
        self.directory = self._dir.path
        self.name = self.source + SUFFIX
        self.path = os.path.join(self.directory, self.name)
        self._written: tuple[int, int] | None = None  # (st_dev, st_ino) of our file
        self._host = socket.gethostname()
        self._process_start = process_start_ticks(self.pid)
        self.sequence = 0
        self.errors = 0
        self.last_snapshot: Snapshot | None = None
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
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

    def _publish_safely(self) -> None:
        """Publish; a failure is counted and logged, never raised (it must not fail an
        allocation, nor stop the thread); the next try is an interval later."""
        try:
            self.publish()
        except Exception:
            self.errors += 1
            self._next_due = time.monotonic() + self.interval
            log.exception("publisher %s: publishing to %s failed; retrying", self.source, self.path)

    def publish(self) -> Snapshot:
        """Take a snapshot and write it now."""
        self._next_due = time.monotonic() + self.interval
        snap = self.ledger.snapshot()
        with self._write_lock:
            if self._closed:
                return snap
            self.sequence += 1
            envelope: dict[str, Any] = {
                "kvledger_publish": ENVELOPE_SCHEMA,
                "source": self.source,
                "pid": self.pid,
                "host": self._host,
                "process_start": self._process_start,
                "interval": self.interval,
                "published_at": time.time(),
                "sequence": self.sequence,
                "snapshot": snap.to_dict(),
            }
            self._write(encode(envelope))
            self.last_snapshot = snap
        return snap

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

    def _run(self) -> None:
        while not self._stop.is_set():
            # An allocating engine moves `_next_due` ahead itself; wake only when it is an
            # interval overdue, i.e. nothing has published for two intervals.
            wait = self._next_due + self.interval - time.monotonic()
            if wait > 0:
                self._stop.wait(wait)
                continue
            self._publish_safely()

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop publishing and remove the file. Idempotent."""
        if self._stop.is_set() and self._closed:
            return
        self._stop.set()
        if self.ledger._event_hook == self._publish_if_due:
            self.ledger.set_event_hook(None)
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
