"""VMM allocator for the sliding-window KV pool, over CUDA or a host backend of the same semantics.

At the root: the backends (`backend`, `host`, `cuda`), one page id across the layers
(`pages`), the page store (`store`) with its spare policy (`spares`), its reporting
(`reporting`) and its background mapper (`mapper`), and errors and checks. On the store:
kvledger's token slots (`allocator.slots`), an engine's rows (`allocator.rows`) and tensor
parallelism (`allocator.tp`). docs/allocator.md.
"""

from allocator.errors import (
    CapacityError,
    ClosedError,
    DriverError,
    IncompatibleError,
    KvAllocatorError,
    SlotError,
)
from allocator.host import HostBackend
from allocator.mapper import BackgroundMapper
from allocator.slots import SlotLayout, SwaPool
from allocator.states import PageState
from allocator.store import PageStore

__all__ = [
    "BackgroundMapper",
    "CapacityError",
    "ClosedError",
    "DriverError",
    "HostBackend",
    "IncompatibleError",
    "KvAllocatorError",
    "PageState",
    "PageStore",
    "SlotError",
    "SlotLayout",
    "SwaPool",
]
