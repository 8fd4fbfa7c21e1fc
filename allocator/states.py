"""The state of a page id in the page store (allocator.store): one enum for every module.

The store keeps one byte per page id in a `bytearray` of these values, so the slot
allocators read it as it is (`state[p] == PageState.MAPPED`) and, vectorised, through a numpy
view of the same buffer (allocator.rows).
"""

from __future__ import annotations

from enum import IntEnum


class PageState(IntEnum):
    """What a page id holds in every layer buffer of the store."""

    UNMAPPED = 0  # no physical memory at this page id; touching it faults
    MAPPED = 1  # mapped and accessible in every layer
    # In a map or unmap transaction the lock does not cover: a background step
    # (allocator.mapper) is calling the driver for it, or a TP rank has reserved it to map
    # ahead (allocator.tp). Neither allocatable nor unmappable until the transaction ends.
    BUSY = 2
