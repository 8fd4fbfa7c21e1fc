"""BackgroundMapper: spare pages mapped ahead of demand and unmapped behind it, off the
allocation path, with the accounting still exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from allocator.errors import CapacityError, SlotError
from allocator.host import HostBackend
from allocator.mapper import BackgroundMapper
from allocator.slots.layout import SlotLayout
from tests.allocator.rigs import SMALL_GRANULARITY, Rig
from tests.allocator.slots.test_pool import _mapped_pages, _physical

PAGE = SMALL_GRANULARITY
SLOTS_PER_PAGE = 4

MakeRig = Callable[..., Rig]


def test_background_mapper_keeps_spares_between_the_watermarks(rig_factory: MakeRig) -> None:
    rig = rig_factory(min_spare_pages=2, max_spare_pages=3, handle_pool_pages=0)
    pool = rig.pool
    with BackgroundMapper(pool, idle_seconds=0.01) as mapper:
        assert mapper.wait_idle()
        assert pool.stats()["spare_pages"] == 2  # mapped ahead of demand
        assert _physical(rig) == (3 * 3 * PAGE,) * 3
        created = rig.backend.stats()["handles"]
        ids = pool.alloc(3 + SLOTS_PER_PAGE)  # page 0's rest and one spare page
        assert rig.backend.stats()["handles"] >= created
        assert mapper.wait_idle()
        assert pool.stats()["spare_pages"] == 2  # refilled behind the allocation
        more = pool.alloc(8 * SLOTS_PER_PAGE)
        assert mapper.wait_idle()
        pool.free(more)
        pool.free(ids)
        assert mapper.wait_idle()
        assert pool.stats()["spare_pages"] == 3  # trimmed to the high watermark
        mapped = len(_mapped_pages(pool))
        assert mapped == 1 + 3
        assert _physical(rig) == (mapped * 3 * PAGE,) * 3
        assert mapper.errors == 0
    # with the mapper gone the pool maps synchronously again
    assert pool.store.mapper is None
    pool.alloc(20)


def test_background_mapper_respects_the_budget(rig_factory: MakeRig) -> None:
    rig = rig_factory(min_spare_pages=5, max_spare_pages=6, physical_budget=3 * 3 * PAGE)
    pool = rig.pool
    with BackgroundMapper(pool, idle_seconds=0.01) as mapper:
        assert mapper.wait_idle()
        assert pool.stats()["live_handle_sets"] == 3
        assert pool.stats()["spare_pages"] == 2
        before = rig.state()
        with pytest.raises(CapacityError, match="physical_budget"):
            pool.alloc(3 + 2 * SLOTS_PER_PAGE + 1)
        assert rig.state() == before


def test_pool_close_stops_its_background_mapper(rig_factory: MakeRig) -> None:
    rig = rig_factory(min_spare_pages=2, max_spare_pages=3)
    mapper = BackgroundMapper(rig.pool, idle_seconds=0.01)
    assert mapper.wait_idle()
    rig.pool.close()
    assert not mapper.running
    mapper.close()  # still idempotent


def test_a_second_background_mapper_is_refused(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    with BackgroundMapper(rig.pool), pytest.raises(ValueError, match="already has"):
        BackgroundMapper(rig.pool)


def test_no_driver_call_on_an_allocation_that_finds_a_spare_page(
    rig_factory: MakeRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = rig_factory(min_spare_pages=2, max_spare_pages=4)
    with BackgroundMapper(rig.pool, idle_seconds=0.01) as mapper:
        assert mapper.wait_idle()
    # the mapper is stopped so that every driver call below would be the allocation's own
    calls: list[str] = []
    for op in ("create", "map", "set_access", "unmap", "release"):
        real = getattr(rig.backend, op)

        def spy(*a: object, _op: str = op, _real: Callable[..., object] = real) -> object:
            calls.append(_op)
            return _real(*a)

        monkeypatch.setattr(rig.backend, op, spy)
    ids = rig.pool.alloc(3 + 2 * SLOTS_PER_PAGE)  # the null page's rest and both spares
    assert calls == []
    rig.pool.alloc(1)  # now a page must be mapped
    assert calls.count("map") == rig.pool.layers
    rig.pool.free(ids)


def test_wait_idle_and_close_are_safe_to_repeat(rig_factory: MakeRig) -> None:
    rig = rig_factory(min_spare_pages=1, max_spare_pages=1)
    mapper = BackgroundMapper(rig.pool, idle_seconds=0.01)
    assert mapper.wait_idle() and mapper.wait_idle()
    mapper.close()
    mapper.close()
    assert rig.pool.store.mapper is None
    assert not mapper.running


class _GatedBackend:
    """Delegates to a host backend; `map` calls at `gate_address` wait for `release_gate`."""

    def __init__(self, inner: Any, gate_address: int) -> None:
        self.inner = inner
        self.name = "gated"
        self.granularity = inner.granularity
        self.gate_address = gate_address
        self.entered = threading.Event()
        self.release_gate = threading.Event()

    def map(self, address: int, size: int, handle: int) -> None:
        if address == self.gate_address:
            self.entered.set()
            assert self.release_gate.wait(10)
        self.inner.map(address, size, handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_occupy_waiting_on_a_busy_page_rechecks_its_ids(host: HostBackend) -> None:
    """occupy() waits while the mapper holds a page it needs; an id taken by alloc() in the
    meantime must then be refused, not handed out twice."""
    layout = SlotLayout(capacity_slots=64, slot_bytes=16 * 1024, page_bytes=PAGE)
    gated = _GatedBackend(host, gate_address=-1)
    rig = Rig(gated, layers=2, layout=layout, min_spare_pages=1, max_spare_pages=1)
    gated.gate_address = rig.pool.store.pages.address(0, 1)  # the mapper maps page 1 first
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            rig.pool.occupy([1, 4])  # slot 4 lies on page 1, which the mapper is mapping
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=follow)
    cond = rig.pool.store.cond
    real_wait = cond.wait
    follower_waits = threading.Event()

    def wait(timeout: float | None = None) -> bool:
        if threading.current_thread() is t:
            follower_waits.set()  # occupy found page 1 busy and waits for the mapper
        return real_wait(timeout)

    cond.wait = wait  # type: ignore[method-assign]
    with BackgroundMapper(rig.pool, idle_seconds=0.01):
        assert gated.entered.wait(10)
        t.start()
        assert follower_waits.wait(10) and not errors
        taken = rig.pool.alloc(3).tolist()  # slots 1-3, beside the null slot, no page needed
        assert sorted(taken) == [1, 2, 3]
        gated.release_gate.set()
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], SlotError), errors
    assert sorted(rig.pool.occupied_ids()) == [1, 2, 3]
    assert rig.ledger.snapshot().total("occupied_slots") == 3
    rig.close()


def test_wait_idle_waits_for_maps_with_kept_handle_sets_when_the_budget_is_spent(
    rig_factory: MakeRig,
) -> None:
    rig = rig_factory(max_spare_pages=0, handle_pool_pages=2, physical_budget=3 * 3 * PAGE)
    pool = rig.pool
    pool.free(pool.alloc(3 + 2 * SLOTS_PER_PAGE))  # two page ids unmapped, their sets kept
    assert pool.stats()["kept_handle_sets"] == 2 and pool.stats()["physical_bytes"] == 9 * PAGE
    pool.store.policy.min_spare_pages = pool.store.policy.max_spare_pages = 2
    with BackgroundMapper(pool, idle_seconds=0.01) as mapper:
        assert mapper.wait_idle()
        # the budget allows no fresh set, but the kept ones are mapped ahead
        assert pool.stats()["spare_pages"] == 2
        assert pool.stats()["kept_handle_sets"] == 0
    assert _physical(rig) == (9 * PAGE,) * 3


def test_threads_allocating_and_freeing_beside_the_mapper_keep_the_books(
    rig_factory: MakeRig,
) -> None:
    """Four threads churn alloc/free while the mapper maps ahead and unmaps behind; no slot
    is ever held twice and, once quiet, the pool, the memfd and the ledger agree."""
    layout = SlotLayout(capacity_slots=256, slot_bytes=12 * 1024, page_bytes=PAGE)
    rig = rig_factory(layers=2, layout=layout, min_spare_pages=2, max_spare_pages=4)
    pool = rig.pool
    owner: dict[int, int] = {}
    owner_lock = threading.Lock()
    failures: list[BaseException] = []

    def churn(me: int) -> None:
        held: list[int] = []
        try:
            for step in range(150):
                if held and (step % 3 == 2 or len(held) > 40):
                    k = 1 + step % len(held)
                    out, held = held[:k], held[k:]
                    with owner_lock:
                        for i in out:
                            assert owner.pop(i) == me
                    pool.free(out)
                else:
                    try:
                        got = pool.alloc(1 + (step * 7 + me) % 9).tolist()
                    except CapacityError:
                        continue
                    with owner_lock:
                        for i in got:
                            assert i not in owner, f"slot {i} handed to {me} and {owner[i]}"
                            owner[i] = me
                    held += got
            pool.free(held)
            with owner_lock:
                for i in held:
                    owner.pop(i)
        except BaseException as e:
            failures.append(e)

    with BackgroundMapper(pool, idle_seconds=0.001) as mapper:
        threads = [threading.Thread(target=churn, args=(me,)) for me in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert failures == []
        assert mapper.wait_idle()
        assert mapper.errors == 0
        assert pool.occupied_ids() == []
        stats = pool.stats()
        assert 2 <= stats["spare_pages"] <= 4
        assert _physical(rig) == (stats["live_handle_sets"] * 2 * PAGE,) * 3
        snap = rig.ledger.snapshot()
        assert snap.violations == ()
        assert snap.total("mapped_bytes") == stats["mapped_pages"] * 2 * PAGE
        assert snap.total("occupied_slots") == 0


def test_a_spare_a_map_puts_over_the_watermark_goes_after_the_grace_with_no_release() -> None:
    """A map the mapper began under the watermark can end over it (releases came meanwhile):
    the grace starts then, as at a release, and the mapper trims once it is over; before,
    the spare stayed mapped until the next release."""
    from allocator.store import PageStore

    with HostBackend(PAGE) as be:
        store = PageStore(
            be, layers=1, page_bytes=PAGE, num_pages=8, max_spare_pages=1, unmap_grace_s=0.05
        )
        with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
            with store.lock:
                store.map_locked([1, 2])  # two spares: one over, within grace_pages (1)
                assert len(store.spares) == 2
            deadline = time.monotonic() + 5
            while len(store.spares) > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(store.spares) == 1
            assert mapper.errors == 0


def test_the_grace_keeps_a_spare_wanted_ahead_and_trims_it_once_it_is_not() -> None:
    """Within max_spare_pages + grace_pages, the grace unmaps stale spares only: a spare a
    follower wants ahead stays mapped past it (its take would map it again: a pause longer
    than the grace between two wide allocations cost a map and an unmap each time). Once it
    is no longer wanted, the grace trims it; beyond the cap a wanted spare still goes."""
    from allocator.store import PageStore

    with HostBackend(PAGE) as be:
        store = PageStore(
            be, layers=1, page_bytes=PAGE, num_pages=8, max_spare_pages=1, unmap_grace_s=0.02
        )
        with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
            with store.lock:
                store.map_locked([1, 2])  # one over the watermark, within grace_pages (1)
                store.policy.set_ahead([1, 2])
            time.sleep(0.1)  # five graces
            assert mapper.wait_idle()
            assert sorted(store.spares) == [1, 2]  # both wanted: both stay
            with store.lock:
                store.policy.set_ahead([1])  # page 2 stale now
            assert mapper.wait_idle()
            assert list(store.spares) == [1]
            with store.lock:
                store.map_locked([2, 3])
                store.policy.set_ahead([1, 2, 3])  # two over the watermark: past the cap
            assert mapper.wait_idle()
            assert len(store.spares) == 2  # the cap (1 + grace_pages) holds for wanted ones
            assert mapper.errors == 0


class _AskedFence:
    """Done only once someone waited for it, as the bridge's device-wide fence on CUDA
    (`readback.DeviceFence`: a synchronisation, never polled)."""

    def __init__(self) -> None:
        self.waited = 0

    def done(self) -> bool:
        return self.waited > 0

    def wait(self) -> None:
        self.waited += 1


def test_a_fenced_spare_the_grace_keeps_is_no_work_for_the_mapper() -> None:
    """A spare wanted ahead, kept past the grace within max_spare_pages + grace_pages, with a
    fence that is done only once waited for: the mapper is idle at once (it has nothing to
    unmap, so nothing to wait for) and never waits for that fence. Once the page is stale, its
    fence is waited for and the page unmapped. (Counting such a fence as work left
    `wait_idle` to its timeout after every round of the bench's 4096 round trip on CUDA.)"""
    from allocator.store import PageStore

    with HostBackend(PAGE) as be:
        store = PageStore(
            be, layers=1, page_bytes=PAGE, num_pages=8, max_spare_pages=1, unmap_grace_s=0.02
        )
        fence = _AskedFence()
        with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
            with store.lock:
                store.map_locked([1, 2])  # one over the watermark, within grace_pages (1)
                store.policy.set_ahead([1, 2])
                store.policy.fence([1, 2], fence)
            time.sleep(0.1)  # five graces
            t0 = time.monotonic()
            assert mapper.wait_idle(timeout=2.0)
            assert time.monotonic() - t0 < 1.0
            assert sorted(store.spares) == [1, 2]
            assert fence.waited == 0
            with store.lock:
                store.policy.set_ahead([1])  # page 2 stale: the trim's, once its fence is done
                store.cond.notify_all()
            assert mapper.wait_idle(timeout=2.0)
            assert list(store.spares) == [1]
            assert fence.waited == 1
            assert mapper.errors == 0
