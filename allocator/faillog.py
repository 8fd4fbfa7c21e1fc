"""Driver and OS failures of the page store: counted, and logged at most one line per interval.

At an operating-system or driver limit (the process's map count, the file-size limit,
device memory) every allocation that needs a new page fails, possibly many times a
second. A traceback per failure would fill the log and hide everything else, so the
store counts each failure here and logs one line per `LOG_INTERVAL_S` with how many
failed since the last line and the latest error (docs/allocator.md#behaviour-at-the-limits).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("allocator.store")

LOG_INTERVAL_S = 10.0  # at most one log line per store per interval


class FailureLog:
    def __init__(self, name: str, *, interval_s: float = LOG_INTERVAL_S) -> None:
        self.name = name
        self.interval_s = interval_s
        self.total = 0
        self.by_op: dict[str, int] = {}
        self._pending = 0
        self._last_line = -float("inf")

    def record(self, op: str, error: BaseException) -> None:
        """Count one failed `op` (map, unmap, create, release, ...) and log it rate-limited."""
        self.total += 1
        self.by_op[op] = self.by_op.get(op, 0) + 1
        self._pending += 1
        now = time.monotonic()
        if now - self._last_line >= self.interval_s:
            log.warning(
                "page store %r: %d driver/OS failure(s) since the last report (%d in all); "
                "latest: %s: %s: %s",
                self.name,
                self._pending,
                self.total,
                op,
                type(error).__name__,
                error,
            )
            self._pending = 0
            self._last_line = now
