"""Time the garbage collector spends, read around a piece of work (`gc.callbacks`).

`GcClock` adds up the collections that finish while it is installed (on any thread: the
collector runs on the thread that triggered it, holding the interpreter), so a caller that
reads `ns` (or `seconds`) and `count` before and after a step knows how much of the step
was a collection. Used by the vLLM plugin's cost mode (`engines/vllm/cost.py`) and by the
benchmarks' loops. Installed by `install()` or the context manager; `close()` (idempotent)
takes it out.
"""

from __future__ import annotations

import gc
from time import perf_counter_ns
from typing import Any


class GcClock:
    __slots__ = ("_installed", "_t0", "count", "ns")

    def __init__(self) -> None:
        self.ns = 0  # collections finished while installed, summed
        self.count = 0
        self._t0 = 0
        self._installed = False

    @property
    def seconds(self) -> float:
        return self.ns / 1e9

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = perf_counter_ns()
        elif self._t0:
            self.ns += perf_counter_ns() - self._t0
            self.count += 1
            self._t0 = 0

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
