"""Sources left out of a scrape: counted by reason, logged by name, at a bounded rate.

One source that cannot be read or rendered must not fail a scrape for the others,
nor fill the log: `SourceFailures.failed` counts the failure under a reason from a
fixed set (`exporter.metrics.SOURCE_ERROR_REASONS`, the label of
`kvledger_source_errors_total`) and logs it with the source's name and traceback,
at most once per `log_every` seconds per source (the next line says how many were
held back). A failure of the same version of a source (`version`, e.g. the published
snapshot it came from) is counted and logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

LOG_EVERY_S = 60.0
_MAX_SOURCES = 4096  # sources remembered for rate limiting; forgotten all at once past it


class SourceFailures:
    def __init__(
        self,
        reasons: tuple[str, ...],
        log: logging.Logger,
        *,
        log_every: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counts: dict[str, int] = dict.fromkeys(reasons, 0)
        self._log = log
        self._log_every = log_every
        self._clock = clock
        self._last: dict[tuple[str, str], tuple[float, int, object]] = {}

    def failed(
        self, reason: str, source: str, error: BaseException, version: object = None
    ) -> None:
        """Count `source`'s failure under `reason` and log it (rate-limited); nothing when
        this `version` of it failed already."""
        if reason not in self.counts:
            raise ValueError(f"failed: reason={reason!r}, expected one of {tuple(self.counts)}")
        key = (reason, source)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and version is not None and last[2] is version:
            return
        self.counts[reason] += 1
        if last is not None and now - last[0] < self._log_every:
            self._last[key] = (last[0], last[1] + 1, version)
            return
        if len(self._last) >= _MAX_SOURCES:
            self._last.clear()
        held = f" ({last[1]} more since the last line)" if last is not None and last[1] else ""
        self._log.error(
            "source %s left out of the scrape (%s failed)%s: %s: %s",
            source,
            reason,
            held,
            type(error).__name__,
            error,
            exc_info=error,
        )
        self._last[key] = (now, 0, version)
