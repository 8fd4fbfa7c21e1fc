"""The narrow interface through which an allocator reports what it really did.

An allocator calls ``on_pool_event`` after each change of physical memory or
mappings has happened (a driver call returned), never before, so the ledger
counts facts rather than intentions. ``count`` is in page ids for page events
(one page id is one page in every layer buffer of the pool) and in slots for
slot events.

Slots change on every allocation, so an allocator does not report each change:
it keeps its own count and reports the figure itself with ``on_slots`` (the
occupied count now, and the highest it reached since the last report), at the
latest before its next page event, every few calls, and whenever the observer
asks through the ``flush`` callable the allocator attached. So the observer
always holds a state the allocator was really in, and the allocation path
pays an integer update rather than a call. ``at_safe_point`` is called outside
the allocator's locks, every few calls, for bounded work such as publishing.
``SLOTS_OCCUPIED`` / ``SLOTS_FREED`` events remain for owners that report
changes one by one (runtime-owned buffers).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol


class PoolEvent(enum.Enum):
    HANDLES_CREATED = "handles_created"  # physical memory committed for `count` page ids
    HANDLES_RELEASED = "handles_released"  # physical memory of `count` page ids given back
    PAGES_MAPPED = "pages_mapped"  # `count` page ids mapped into every layer; `seconds` spent
    PAGES_UNMAPPED = "pages_unmapped"  # `count` page ids unmapped from every layer
    # `count` driver or OS calls failed (map, unmap, create, release: a limit such as the
    # map count, the file-size limit or device memory); nothing held was leaked (allocator.store)
    DRIVER_FAILURES = "driver_failures"
    SLOTS_OCCUPIED = "slots_occupied"  # `count` slots handed to live requests
    SLOTS_FREED = "slots_freed"  # `count` slots returned


class PoolObserver(Protocol):
    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None: ...

    def on_slots(self, occupied: int, peak: int) -> None:
        """`occupied` slots are held now; `peak` is the most held since the last report."""

    def attach(self, flush: Callable[[], None]) -> None:
        """`flush()` makes the allocator report its slots now (call it outside its locks)."""

    def detach(self, flush: Callable[[], None]) -> None:
        """The allocator attached with `flush` is closed."""

    def at_safe_point(self) -> None:
        """Called outside the allocator's locks every few calls: bounded work may run here."""
