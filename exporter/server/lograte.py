"""A bound on how fast `kvledger serve` writes warnings and errors, whatever goes wrong.

One failing thing (a directory that runs out of descriptors, a flood of bad requests
uvicorn warns about, a publisher that cannot write) must not fill the log: `RateLimit`,
a `logging.Filter` on the handlers, lets through the first warning or error of each kind
(logger, level and message template) and then at most one per `every` seconds; the next
one let through says how many were held back. Lines below WARNING (the status line) pass
as they are. At most `MAX_KINDS` kinds are remembered (forgotten all at once past it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

EVERY_S = 60.0
MAX_KINDS = 4096


class RateLimit(logging.Filter):
    def __init__(self, every: float = EVERY_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        if not 0 < every < float("inf"):
            raise ValueError(f"RateLimit: every={every!r}, expected seconds > 0")
        self.every = every
        self._clock = clock
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}
        self.held = 0  # lines held back so far

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every:
            self._last[key] = (last[0], last[1] + 1)
            self.held += 1
            return False
        if len(self._last) >= MAX_KINDS:
            self._last.clear()
        self._last[key] = (now, 0)
        if last is not None and last[1]:
            record.msg = f"{record.msg} [{last[1]} more like this held back in {self.every:g} s]"
        return True


def install(limit: RateLimit, loggers: Iterable[str] = ("", "uvicorn")) -> None:
    """Put `limit` on every handler of `loggers` (the root's and uvicorn's own)."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if limit not in handler.filters:
                handler.addFilter(limit)
