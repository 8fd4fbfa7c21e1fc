"""The page store's occupant figure and its observer (accounting.events).

The slot allocator on top keeps its occupant count in the store (`add_occupied`); the
store reports it with `on_slots` before every page event, every `REPORT_EVERY` allocator
calls (`tick`, then `safe_point` outside the lock) and when the observer flushes, so an
allocation costs the observer nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from accounting.events import PoolEvent, PoolObserver

if TYPE_CHECKING:
    from allocator.faillog import FailureLog

REPORT_EVERY = 64  # allocator calls between two occupant reports and safe points


class _NullObserver:
    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        pass

    def on_slots(self, occupied: int, peak: int) -> None:
        pass

    def attach(self, flush: Callable[[], None]) -> None:
        pass

    def detach(self, flush: Callable[[], None]) -> None:
        pass

    def at_safe_point(self) -> None:
        pass


class Reporter:
    """Mixed into allocator.store.PageStore; the attributes below are the store's."""

    if TYPE_CHECKING:
        observer: PoolObserver
        lock: threading.RLock
        closed: bool
        occupied: int
        _peak: int
        _reported: int
        _calls: int
        pages_mapped_total: int
        pages_unmapped_total: int
        failures: FailureLog

    # -- occupants and the observer ------------------------------------------------------------
    def add_occupied(self, n: int) -> None:
        count = self.occupied = self.occupied + n
        if count > self._peak:
            self._peak = count

    def report_slots(self) -> None:
        """Report the occupant figure to the observer now (its `flush`); a no-op once closed."""
        with self.lock:
            if not self.closed:
                self.report_slots_locked()

    def report_slots_locked(self) -> None:
        count = self.occupied
        if count != self._reported or self._peak != count:
            self.observer.on_slots(count, max(self._peak, count))
            self._reported = self._peak = count

    def tick(self) -> bool:
        """Count one allocator call (under the lock); True when a safe point is due."""
        self._calls += 1
        return self._calls >= REPORT_EVERY

    def safe_point(self) -> None:
        """Report and let the observer do bounded work; call outside the lock."""
        self._calls = 0
        self.report_slots()
        self.observer.at_safe_point()

    def emit(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        """Report a page or handle event (under the lock), the occupants it follows first."""
        self.report_slots_locked()
        if event is PoolEvent.PAGES_MAPPED:
            self.pages_mapped_total += count
        elif event is PoolEvent.PAGES_UNMAPPED:
            self.pages_unmapped_total += count
        self.observer.on_pool_event(event, count, seconds)

    def _failed(self, op: str, error: BaseException) -> None:
        self.failures.record(op, error)
        self.emit(PoolEvent.DRIVER_FAILURES, 1)
