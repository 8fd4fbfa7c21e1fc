"""Time the garbage collector spends, read around a piece of work (`gc.callbacks`).

`GcClock` adds up the collections that finish while it is installed (on any thread: the
collector runs on the thread that triggered it, holding the interpreter), so a caller that
reads `seconds` before and after a step knows how much of the step was a collection.
Installed by `install()` or the context manager; `close()` (idempotent) takes it out.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    def __init__(self) -> None:
        self.seconds = 0.0  # collections finished while installed, summed
        self.count = 0
        self._t0 = 0.0
        self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1
            self._t0 = 0.0

    def install(self) -> GcClock:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            self._installed = False
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)

    def __enter__(self) -> GcClock:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()
