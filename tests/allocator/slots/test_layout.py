"""SlotLayout: where a slot's bytes lie and which pages they touch."""

from __future__ import annotations

import pytest

from allocator.errors import IncompatibleError
from allocator.slots.layout import SlotLayout
from tests.allocator.rigs import DSV4_ROW_BYTES, DSV4_SLOT_BYTES, DSV4_SLOTS_PER_ROW, KIB


def test_plain_layout_is_capacity_by_slot_bytes() -> None:
    lay = SlotLayout(capacity_slots=10, slot_bytes=100, page_bytes=4 * KIB)
    assert lay.row_bytes == 100 and lay.rows == 10
    assert lay.buffer_bytes == 1000
    assert lay.num_pages == 1 and lay.reserved_bytes == 4 * KIB
    assert [lay.slot_offset(i) for i in (0, 1, 9)] == [0, 100, 900]


def test_dsv4_rows_are_padded_and_slots_straddle_pages() -> None:
    assert DSV4_ROW_BYTES % 576 == 0 and DSV4_ROW_BYTES >= DSV4_SLOTS_PER_ROW * DSV4_SLOT_BYTES
    lay = SlotLayout(
        capacity_slots=3 * DSV4_SLOTS_PER_ROW,
        slot_bytes=DSV4_SLOT_BYTES,
        page_bytes=64 * KIB,
        slots_per_row=DSV4_SLOTS_PER_ROW,
        row_bytes=DSV4_ROW_BYTES,
    )
    assert lay.rows == 3
    assert lay.buffer_bytes == 3 * DSV4_ROW_BYTES
    assert lay.num_pages == -(-3 * DSV4_ROW_BYTES // (64 * KIB))
    assert lay.reserved_bytes == lay.num_pages * 64 * KIB
    # the first slot of row 1 starts after row 0's padding
    assert lay.slot_offset(256) == DSV4_ROW_BYTES
    assert lay.slot_offset(257) == DSV4_ROW_BYTES + DSV4_SLOT_BYTES
    # slot 112 starts at 65408 and ends at 65991: it straddles pages 0 and 1
    assert lay.slot_offset(112) == 112 * 584
    assert lay.slot_pages(112) == (0, 1)
    assert lay.slot_pages(111) == (0, 0)
    straddling = [i for i in range(lay.capacity_slots) if len(set(lay.slot_pages(i))) == 2]
    assert straddling, "this layout must have slots on two pages"
    for i in range(lay.capacity_slots):
        a, b = lay.slot_pages(i)
        assert b - a in (0, 1)
        assert b < lay.num_pages


def test_capacity_not_a_multiple_of_the_row_rounds_rows_up() -> None:
    lay = SlotLayout(capacity_slots=257, slot_bytes=584, page_bytes=64 * KIB, slots_per_row=256)
    assert lay.rows == 2 and lay.buffer_bytes == 2 * 256 * 584


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("capacity_slots", {"capacity_slots": 0}),
        ("slot_bytes", {"slot_bytes": -1}),
        ("page_bytes", {"page_bytes": 0}),
        ("slots_per_row", {"slots_per_row": 0}),
        ("capacity_slots", {"capacity_slots": 2.5}),
    ],
)
def test_bad_values_are_refused_by_name(field: str, kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"capacity_slots": 8, "slot_bytes": 64, "page_bytes": 4096}
    with pytest.raises(IncompatibleError, match=field):
        SlotLayout(**{**base, **kwargs})  # type: ignore[arg-type]


def test_row_bytes_smaller_than_its_slots_is_refused() -> None:
    with pytest.raises(IncompatibleError, match="row_bytes=100"):
        SlotLayout(capacity_slots=8, slot_bytes=64, page_bytes=4096, slots_per_row=2, row_bytes=100)


def test_a_slot_larger_than_a_page_is_refused() -> None:
    with pytest.raises(IncompatibleError, match="slot_bytes=8192"):
        SlotLayout(capacity_slots=8, slot_bytes=8192, page_bytes=4096)
