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
            pool.store.policy.trim_locked()
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


def test_pages_reserved_ahead_are_mapped_off_the_lock_published_and_given_back(
    backend: HostBackend,
) -> None:
    """TpPages on its own (no group): a reserve is all or nothing, a failed map ahead is
    counted and leaves the page reserved, publishing maps it here, and giving the reserve
    back returns everything, the driver failing or not."""
    from allocator.errors import DriverError
    from tests.allocator.rigs import FailingBackend

    fb = FailingBackend(backend)
    with SwaPool(fb, layers=2, layout=LAYOUT, max_spare_pages=1, handle_pool_pages=0) as pool:
        store, tp = pool.store, TpPages(pool.store)
        before = store.debug_state()
        with store.lock, pytest.raises(RuntimeError, match="page 0 to map is MAPPED"):
            tp.reserve_locked([5, 0])  # page 0 holds the null slot
        assert store.debug_state() == before and tp.reserved == {}
        with store.lock:
            tp.reserve_locked([5, 6, 7])
            assert [tp.page_state(p) for p in (5, 6, 7)] == ["reserved"] * 3
            job = tp.next_job_locked()
        assert job is not None and job.page == 5 and store.busy == 1
        fb.arm("map", 1)
        with pytest.raises(DriverError, match="INJECTED"):
            tp.map_ahead(job)  # the coordinator's thread: off the lock
        assert store.stats()["driver_failures"] == 1 and store.busy == 0
        assert not tp.idle() and tp.page_state(5) == "reserved"
        fb.arm(None, None)
        with store.lock:
            job = tp.next_job_locked()
        assert job is not None and job.page == 5
        tp.map_ahead(job)
        with store.lock:
            tp.publish_locked([5, 6])  # 5 mapped ahead, 6 mapped here
        assert pool.is_page_mapped(5) and pool.is_page_mapped(6)
        assert sorted(tp.reserved) == [7] and tp.state()["reserved_pages"] == 1
        with store.lock:
            job = tp.next_job_locked()
        assert job is not None
        tp.map_ahead(job)
        fb.arm("unmap", 0)
        with store.lock:
            tp.drop_locked()  # the unmap fails: counted, the page given back regardless
        assert tp.reserved == {} and store.stats()["driver_failures"] == 2
        assert tp.page_state(7) == "unmapped" and store.busy == 0
        fb.arm(None, None)
        assert store.stats()["live_handle_sets"] == 3  # the null slot's page, 5 and 6
    # What the failed unmap left, one layer's mapping, its handle and the reservation around
    # it, is the backend's to free at its own close (docs/allocator.md#behaviour-at-the-limits).
    held = backend.stats()
    assert (held["mappings"], held["handles"], held["reservations"]) == (1, 1, 1)
