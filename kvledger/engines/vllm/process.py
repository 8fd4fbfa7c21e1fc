"""One vLLM process's ledger and its published file."""

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
    publisher stops (its file goes), then every part is released."""

    def __init__(self, labels: Mapping[str, str], *, directory: str, interval: float) -> None:
        self.ledger = Ledger(labels)
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
        due); `before()` runs first (a refresh of the figures). True when it published."""
        now = time.monotonic()
        if now < self._next or self.publisher is None or self._closed:
            return False
        self._next = now + self.interval
        if before is not None:
            before()
        self.publisher.publish()
        return True

    def publish_now(self, before: Any = None) -> bool:
        """Publish at once (the engine went idle: its last step's frees must not wait for
        a next step); `before()` runs first. True when it published."""
        if self.publisher is None or self._closed:
            return False
        self._next = time.monotonic() + self.interval
        if before is not None:
            before()
        self.publisher.publish()
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
