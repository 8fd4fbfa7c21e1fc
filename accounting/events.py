"""The narrow interface through which an allocator reports what it really did.

An allocator calls ``on_pool_event`` after each change has happened (a driver
call returned, a slot left the free list), never before, so the ledger counts
facts rather than intentions. ``count`` is in page ids for page events (one page
id is one page in every layer buffer of the pool) and in slots for slot events.
"""

from __future__ import annotations

import enum
from typing import Protocol


class PoolEvent(enum.Enum):
    HANDLES_CREATED = "handles_created"  # physical memory committed for `count` page ids
    HANDLES_RELEASED = "handles_released"  # physical memory of `count` page ids given back
    PAGES_MAPPED = "pages_mapped"  # `count` page ids mapped into every layer; `seconds` spent
    PAGES_UNMAPPED = "pages_unmapped"  # `count` page ids unmapped from every layer
    SLOTS_OCCUPIED = "slots_occupied"  # `count` slots handed to live requests
    SLOTS_FREED = "slots_freed"  # `count` slots returned


class PoolObserver(Protocol):
    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None: ...
