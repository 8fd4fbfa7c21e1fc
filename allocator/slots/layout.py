"""Slot geometry of a per-layer buffer: where a slot's bytes lie and which pages they touch.

Slots are laid out in rows: slot `i` lies in row `i // slots_per_row`, at
`row * row_bytes + (i % slots_per_row) * slot_bytes`. With one slot per row this
is a plain `[capacity, slot_bytes]` buffer; DeepSeek-V4's SWA buffer is 256
tokens per row, each row padded to a multiple of 576 bytes. A slot may straddle
two pages (slot_bytes need not divide the page); a slot larger than a page is
refused (see allocator.activation).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from allocator.errors import IncompatibleError


@dataclass(frozen=True)
class SlotLayout:
    capacity_slots: int
    slot_bytes: int
    page_bytes: int
    slots_per_row: int = 1
    row_bytes: int = 0  # 0: slots_per_row * slot_bytes, no padding

    def __post_init__(self) -> None:
        for name in ("capacity_slots", "slot_bytes", "page_bytes", "slots_per_row"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise IncompatibleError(f"SlotLayout: {name}={value!r}, expected a positive int")
        if self.row_bytes == 0:
            object.__setattr__(self, "row_bytes", self.slots_per_row * self.slot_bytes)
        if self.row_bytes < self.slots_per_row * self.slot_bytes:
            raise IncompatibleError(
                f"SlotLayout: row_bytes={self.row_bytes}, expected >= slots_per_row * slot_bytes "
                f"= {self.slots_per_row * self.slot_bytes}"
            )
        if self.slot_bytes > self.page_bytes:
            raise IncompatibleError(
                f"SlotLayout: slot_bytes={self.slot_bytes} exceeds page_bytes={self.page_bytes}; "
                "expected a slot to touch at most two pages"
            )

    @property
    def rows(self) -> int:
        return -(-self.capacity_slots // self.slots_per_row)

    @property
    def buffer_bytes(self) -> int:
        """Tensor bytes of one layer's buffer."""
        return self.rows * self.row_bytes

    @property
    def num_pages(self) -> int:
        return -(-self.buffer_bytes // self.page_bytes)

    @property
    def reserved_bytes(self) -> int:
        """One layer's reservation: the buffer rounded up to whole pages."""
        return self.num_pages * self.page_bytes

    def slot_offset(self, slot: int) -> int:
        row, col = divmod(slot, self.slots_per_row)
        return row * self.row_bytes + col * self.slot_bytes

    def slot_pages(self, slot: int) -> tuple[int, int]:
        """(first page, last page) the slot's bytes touch; equal unless it straddles."""
        start = self.slot_offset(slot)
        return start // self.page_bytes, (start + self.slot_bytes - 1) // self.page_bytes

    def first_slot_at(self, offset: int) -> int:
        """The first slot whose bytes start at or after `offset`."""
        lo, hi = 0, self.capacity_slots
        while lo < hi:
            mid = (lo + hi) // 2
            if self.slot_offset(mid) < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def page_index(self) -> tuple[array[int], list[int], list[set[int]]]:
        """Per slot, its home page (where its first byte lies, a C array of 4 bytes a slot);
        per page, its tail (the slot straddling into the next page, or -1) and the other
        slots starting in it."""
        cap = self.capacity_slots
        starts = [self.first_slot_at(p * self.page_bytes) for p in range(self.num_pages)]
        starts.append(cap)
        home_of = array("i")
        tails = [-1] * self.num_pages
        inner: list[set[int]] = []
        for p in range(self.num_pages):
            a, b = starts[p], starts[p + 1]
            home_of.extend(array("i", [p]) * (b - a))
            slots = set(range(a, b))
            if b > a and self.slot_pages(b - 1)[1] != p:
                slots.discard(b - 1)
                tails[p] = b - 1
            inner.append(slots)
        return home_of, tails, inner
