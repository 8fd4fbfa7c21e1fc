"""The page store's TP side (allocator.tp.pages) and the TP section of allocator.slots.pool: what
allocator.tp reads and drives, on one pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from allocator import CapacityError, HostBackend, SlotLayout, SwaPool
from allocator.tp import TpPages

GRAN = 4096
LAYOUT = SlotLayout(capacity_slots=256, slot_bytes=584, page_bytes=GRAN)


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    with HostBackend(granularity=GRAN) as b:
        yield b


def mapped(pool: SwaPool) -> set[int]:
    return {p for p in range(LAYOUT.num_pages) if pool.is_page_mapped(p)}


def test_trim_plan_names_the_pages_the_pool_unmaps(backend: HostBackend) -> None:
    with SwaPool(backend, layers=2, layout=LAYOUT, max_spare_pages=1) as pool:
        blocks = [pool.alloc(7) for _ in range(8)]
        for b in blocks[1:6]:
            pool.free(b)  # leaves spares beyond max_spare_pages: trimmed one free at a time
        tp = TpPages(pool.store)
        pool.store.policy.max_spare_pages = 10  # keep the next frees' spares to read a plan first
        for b in blocks[6:]:
            pool.free(b)
        excess = pool.stats()["spare_pages"] - 1
        assert excess > 0
        plan = tp.trim_plan(excess)
        assert [tp.page_state(p) for p in plan] == ["spare"] * excess
        before = mapped(pool)
        pool.store.policy.max_spare_pages = 1
        with pool.store.lock:
            pool.store.trim_locked()
        assert before - mapped(pool) == set(plan)
        pool.free(blocks[0])


def test_tp_state_and_page_states(backend: HostBackend) -> None:
    with SwaPool(backend, layers=2, layout=LAYOUT, max_spare_pages=4) as pool:
        tp = TpPages(pool.store)
        ids = pool.alloc(20)
        with pool.store.lock:
            st = tp.state()
        stats = pool.stats()
        assert st == {
            "occupied_slots": 20,
            "mapped_pages": stats["mapped_pages"],
            "spare_pages": stats["spare_pages"],
            "live_handle_sets": stats["live_handle_sets"],
            "reserved_pages": 0,
        }
        assert tp.page_state(0) == "used"
        assert tp.page_state(LAYOUT.num_pages - 1) == "unmapped"
        pool.free(ids)
        assert "spare" in {tp.page_state(p) for p in mapped(pool)}


def test_tp_config_differs_when_a_choice_could(backend: HostBackend) -> None:
    with (
        SwaPool(backend, layers=2, layout=LAYOUT, max_spare_pages=1) as a,
        SwaPool(backend, layers=2, layout=LAYOUT, max_spare_pages=2) as b,
        SwaPool(backend, layers=2, layout=LAYOUT, max_spare_pages=1) as c,
    ):
        assert a.tp_config() != b.tp_config()
        assert a.tp_config() == c.tp_config()


def test_a_refused_alloc_keeps_the_slots_it_gathered_free(backend: HostBackend) -> None:
    budget = 2 * LAYOUT.page_bytes
    with SwaPool(backend, layers=1, layout=LAYOUT, physical_budget=budget) as pool:
        first = pool.alloc(3)
        before = pool.stats()
        with pytest.raises(CapacityError, match="over the budget"):
            pool.alloc(LAYOUT.capacity_slots - 10)
        assert pool.stats() == before
        # every slot of the two mapped pages can still be handed out
        free_in_mapped = 0
        while True:
            try:
                pool.alloc(1)
            except CapacityError:
                break
            free_in_mapped += 1
        assert pool.stats()["mapped_pages"] == 2
        assert before["occupied_slots"] + free_in_mapped == pool.stats()["occupied_slots"]
        assert free_in_mapped >= 2 * (GRAN // LAYOUT.slot_bytes) - 1 - len(first) - 1
