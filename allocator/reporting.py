"""What the page store tells its observer (accounting.events): the occupant figure and events.

The slot allocator on top keeps its occupant count in the store's `Reporter`
(`add_occupied`); the reporter hands it to the observer with `on_slots` before every page
event, every `REPORT_EVERY` allocator calls (`tick`, then the store's `safe_point` outside
the lock) and when the observer flushes (the store's `report_slots`), so an allocation that
maps nothing costs the observer nothing. Every page and handle event, and every failed
driver call (`failed`, counted and logged rate-limited by allocator.faillog), goes through
`emit`. The store holds one reporter and calls it with its lock held: nothing here locks.
"""

from __future__ import annotations

from collections.abc import Callable

from accounting.events import PoolEvent, PoolObserver
from allocator.faillog import FailureLog

REPORT_EVERY = 64  # allocator calls between two occupant reports and safe points


class NullObserver:
    """The observer of a store given none: every report is dropped."""

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
    """The occupant figure and the event stream of one page store (every method: lock held).

    `occupied`: the occupants (slots, rows) the allocator on top holds now;
    `pages_mapped_total` / `pages_unmapped_total`: page ids mapped and unmapped since the
    store was made; `failures`: the failed driver and OS calls (allocator.faillog)."""

    def __init__(self, observer: PoolObserver | None, name: str) -> None:
        self.observer: PoolObserver = observer or NullObserver()
        self.failures = FailureLog(name)
        self.occupied = 0
        self.pages_mapped_total = 0
        self.pages_unmapped_total = 0
        self._peak = 0  # the most occupants since the last report
        self._reported = 0  # the figure the observer holds
        self._calls = 0  # allocator calls since the last safe point

    def add_occupied(self, n: int) -> None:
        """Occupants came (`n` > 0) or left (`n` < 0); the observer hears of it later."""
        count = self.occupied = self.occupied + n
        if count > self._peak:
            self._peak = count

    def report(self) -> None:
        """Hand the occupant figure (and the peak since the last report) to the observer, if
        either changed."""
        count = self.occupied
        if count != self._reported or self._peak != count:
            self.observer.on_slots(count, max(self._peak, count))
            self._reported = self._peak = count

    def tick(self) -> bool:
        """Count one allocator call; True when a safe point is due (the store's `safe_point`,
        outside the lock)."""
        self._calls += 1
        return self._calls >= REPORT_EVERY

    def restart_count(self) -> None:
        """A safe point runs: the next one is due `REPORT_EVERY` calls from now."""
        self._calls = 0

    def emit(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        """Report a page or handle event that has happened, the occupants it follows first."""
        self.report()
        if event is PoolEvent.PAGES_MAPPED:
            self.pages_mapped_total += count
        elif event is PoolEvent.PAGES_UNMAPPED:
            self.pages_unmapped_total += count
        self.observer.on_pool_event(event, count, seconds)

    def failed(self, op: str, error: BaseException) -> None:
        """Count a failed driver or OS call `op` (map, unmap, create, release, ...): logged
        rate-limited, reported as `DRIVER_FAILURES`."""
        self.failures.record(op, error)
        self.emit(PoolEvent.DRIVER_FAILURES, 1)
