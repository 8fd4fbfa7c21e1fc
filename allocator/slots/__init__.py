"""kvledger's own token slots on the page store: `SwaPool` (pool), where its allocations come
from (gather), the slot geometry (layout) and slot ids as callers pass them (slot_ids)."""

from allocator.slots.layout import SlotLayout
from allocator.slots.pool import PoolState, SwaPool
from allocator.slots.slot_ids import as_id_list

__all__ = ["PoolState", "SlotLayout", "SwaPool", "as_id_list"]
