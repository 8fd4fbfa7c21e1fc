"""VMM allocator for the sliding-window KV pool, over CUDA or a host backend of the same semantics."""

from allocator.errors import (
    CapacityError,
    ClosedError,
    DriverError,
    IncompatibleError,
    KvAllocatorError,
    SlotError,
)
from allocator.host import HostBackend
from allocator.layout import SlotLayout
from allocator.mapper import BackgroundMapper
from allocator.pool import SwaPool

__all__ = [
    "BackgroundMapper",
    "CapacityError",
    "ClosedError",
    "DriverError",
    "HostBackend",
    "IncompatibleError",
    "KvAllocatorError",
    "SlotError",
    "SlotLayout",
    "SwaPool",
]
