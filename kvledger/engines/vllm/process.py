"""One vLLM process's ledger and its published file.

Who encodes and writes it. The engine core (`engine_type` `vllm_scheduler`) publishes from
vLLM's scheduler thread, once per interval inside a step (`hooks`): there the refresh reads
vLLM's scheduler objects and the ledger's snapshot is taken, so the figures are one instant
of the refresh (a snapshot taken by another thread mid-refresh could show holders not summing
to the occupied slots); the snapshot is then handed to the publisher's own thread
(`Publisher.submit`), which encodes it and writes the file. The engine core's thread spends
most of each step waiting for the workers' forward with the interpreter released, so that
thread runs then, off the step. (SGLang's plugin publishes on its allocating thread instead:
that thread is busy in Python, and a second thread competing with it for the interpreter
was measured to slow it; accounting.snapfile.writer.) A worker publishes synchronously: only
when its cache is registered or changes (never per step), and its callers read the file
right after.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from accounting.ledger import Ledger
from accounting.snapfile.format import check_interval
from accounting.snapfile.writer import Publisher
from kvledger.engines.vllm.switches import ENV_INTERVAL, ENV_SNAPSHOT_DIR

# The roles (label `engine_type`) whose periodic publishes are handed to the publisher's
# thread (`Publisher.submit`) rather than encoded and written on the caller's.
HANDOFF_ROLES = frozenset({"vllm_scheduler"})


def snapshot_dir(env: Mapping[str, str] | None = None) -> str:
    """`KVLEDGER_SNAPSHOT_DIR`, else the directory `kvledger serve` reads by default."""
    value = (os.environ if env is None else env).get(ENV_SNAPSHOT_DIR, "")
    if value:
        return value
    from accounting.snapfile.directory import default_snapshot_dir

    return default_snapshot_dir()


def publish_interval(env: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if env is None else env).get(ENV_INTERVAL, "") or "1"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_INTERVAL}={raw!r}, expected a positive number of seconds") from None
    return check_interval(value, ENV_INTERVAL)


class ProcessLedger:
    """A ledger, the parts registered in it (each with `close()` or `release(ledger)`),
    and the publisher started once the first part is in. `close()` is idempotent: the
    publisher stops (its file goes), then every part is released.

    `handoff`: `publish_if_due` and `publish_now` take the snapshot on the caller's thread
    and hand it to the publisher's thread to encode and write (`Publisher.submit`); False:
    they publish synchronously. None (the default): True for the roles in `HANDOFF_ROLES`
    (the engine core), from the label `engine_type`. `add` always publishes synchronously
    (the file exists when it returns)."""

    def __init__(
        self,
        labels: Mapping[str, str],
        *,
        directory: str,
        interval: float,
        handoff: bool | None = None,
    ) -> None:
        if handoff is not None and not isinstance(handoff, bool):
            raise TypeError(f"ProcessLedger: handoff={handoff!r}, expected True, False or None")
        self.ledger = Ledger(labels)
        self.handoff = labels.get("engine_type") in HANDOFF_ROLES if handoff is None else handoff
        self.directory = directory
        self.interval = interval
        self.parts: list[Any] = []
        self.publisher: Publisher | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._next = 0.0

    def add(self, part: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("ProcessLedger is closed")
            self.parts.append(part)
            if self.publisher is None:
                self.publisher = Publisher(self.ledger, self.directory, interval=self.interval)
            else:
                self.publisher.publish()

    def publish_if_due(self, before: Any = None) -> bool:
        """Publish when an interval has passed since this process last did (O(1) when not
        due); `before()` runs first (a refresh of the figures), then the snapshot is taken
        here, both on the caller's thread; with `handoff` the publisher's thread encodes and
        writes it. True when it published (or handed the snapshot over)."""
        now = time.monotonic()
        publisher = self.publisher
        if now < self._next or publisher is None or self._closed:
            return False
        self._next = now + self.interval
        return self._publish(publisher, before)

    def publish_now(self, before: Any = None) -> bool:
        """Publish at once (the engine went idle: its last step's frees must not wait for
        a next step); `before()` runs first. True when it published (or handed over)."""
        publisher = self.publisher
        if publisher is None or self._closed:
            return False
        self._next = time.monotonic() + self.interval
        return self._publish(publisher, before)

    def _publish(self, publisher: Publisher, before: Any) -> bool:
        if before is not None:
            before()
        if self.handoff:
            publisher.submit()  # the snapshot here, after the refresh; the rest off this thread
        else:
            publisher.publish()
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            publisher, self.publisher = self.publisher, None
            parts, self.parts = self.parts, []
        try:
            if publisher is not None:
                publisher.close()
        finally:
            for part in reversed(parts):
                if hasattr(part, "release"):
                    part.release(self.ledger)
                else:
                    part.close()

    def __enter__(self) -> ProcessLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
