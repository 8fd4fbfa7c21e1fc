"""PageStore's transactions, attachments and books on their own (the slot allocators' tests
drive them through SwaPool and RowFollower)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accounting.ledger import Ledger
from allocator.errors import CapacityError, DriverError
from allocator.host import HostBackend
from allocator.slots.layout import SlotLayout
from allocator.states import PageState
from allocator.store import PageStore
from tests.allocator.rigs import SMALL_GRANULARITY, FailingBackend, pool_account

G = SMALL_GRANULARITY
PAGES = 8
LAYERS = 3


@pytest.fixture
def host() -> Iterator[HostBackend]:
    with HostBackend(G) as be:
        yield be


def _store(backend: object, **options: object) -> tuple[PageStore, Ledger]:
    ledger = Ledger()
    layout = SlotLayout(capacity_slots=PAGES, slot_bytes=G, page_bytes=G)
    account = pool_account(ledger, LAYERS, layout, null_slot=False)
    store = PageStore(
        backend,  # type: ignore[arg-type]
        layers=LAYERS,
        page_bytes=G,
        num_pages=PAGES,
        observer=account,
        **options,  # type: ignore[arg-type]
    )
    return store, ledger


def _figures(ledger: Ledger) -> dict[str, int]:
    snap = ledger.snapshot()
    return {f: snap.total(f) for f in ("physical_bytes", "mapped_bytes")}


def test_a_map_transaction_driven_off_the_lock_counts_busy_and_ends_mapped(
    host: HostBackend,
) -> None:
    store, ledger = _store(host, max_spare_pages=4)
    with store:
        with store.lock:
            jobs = store.begin_map([2, 5], "map two pages", off_lock=True)
            assert store.busy == 2 and [store.state[p] for p in (2, 5)] == [PageState.BUSY] * 2
            assert 2 not in store.unmapped and store.live_sets == 2
        store.drive_map(jobs)  # off the lock, as the background mapper does
        assert _figures(ledger)["mapped_bytes"] == 0  # nothing reported before the end
        with store.lock:
            store.end_map(jobs, 0.001)
        assert store.busy == 0 and store.is_mapped(2) and store.is_mapped(5)
        assert list(store.spares) == [2, 5]
        assert _figures(ledger) == {
            "physical_bytes": 2 * LAYERS * G,
            "mapped_bytes": 2 * LAYERS * G,
        }
    assert host.stats()["handles"] == 0 and host.physical_bytes() == 0


@pytest.mark.parametrize(("op", "k"), [("create", 0), ("create", 4), ("map", 0), ("map", 5)])
def test_a_failed_drive_aborted_leaves_books_backend_and_ledger_as_before(
    host: HostBackend, op: str, k: int
) -> None:
    """One handle set kept (page 1 was mapped and unmapped), two fresh: whichever call fails,
    the abort puts the kept set back, the fresh ones released, every page unmapped."""
    fb = FailingBackend(host)
    store, ledger = _store(fb, max_spare_pages=0, handle_pool_pages=1)
    with store:
        with store.lock:
            store.map_locked([1])
            store.policy.trim_locked()  # unmapped; its set kept
        assert store.kept_sets == 1
        before = (store.debug_state(), host.debug_state(), _figures(ledger))
        fb.arm(op, k)
        with store.lock, pytest.raises(DriverError, match="INJECTED"):
            store.map_locked([3, 4, 6])
        assert (store.debug_state(), host.debug_state(), _figures(ledger)) == before
        assert store.stats()["driver_failures"] == 1
        assert store.reporter.failures.by_op == {op: 1}
        fb.arm(None, None)
        with store.lock:
            store.map_locked([3, 4, 6])  # the same map works afterwards
        assert all(store.is_mapped(p) for p in (3, 4, 6))
    assert host.stats()["handles"] == 0 and host.stats()["mappings"] == 0


def test_begin_map_refuses_a_page_not_unmapped_and_the_budget_changing_nothing(
    host: HostBackend,
) -> None:
    store, _ = _store(host, physical_budget=2 * LAYERS * G)
    with store, store.lock:
        store.map_locked([0])
        before = store.debug_state()
        with pytest.raises(RuntimeError, match="page 0 to map is MAPPED, expected UNMAPPED"):
            store.begin_map([3, 0], "map")
        with pytest.raises(RuntimeError, match="twice"):
            store.begin_map([3, 3], "map")
        with pytest.raises(CapacityError, match="cannot take rows: physical bytes would be"):
            store.begin_map([3, 4], "take rows")
        assert store.debug_state() == before


def test_a_map_may_land_exactly_on_the_budget_and_not_one_page_over(host: HostBackend) -> None:
    """A bare store (no SGLang facade): `physical_budget` is the most bytes its handle sets
    may hold, so maps that fill it to the byte go through, and one more page is refused."""
    store, ledger = _store(host, physical_budget=3 * LAYERS * G)
    with store, store.lock:
        store.map_locked([0])
        store.map_locked([1, 2])  # lands on the budget exactly
        assert store.live_sets * store.set_bytes == store.physical_budget
        assert _figures(ledger)["physical_bytes"] == 3 * LAYERS * G
        assert not store.budget_allows(1)
        before = store.debug_state()
        over = 4 * LAYERS * G
        with pytest.raises(CapacityError, match=f"physical bytes would be {over}, over the"):
            store.map_locked([3], "map one page over")
        assert store.debug_state() == before


def test_an_unmap_transaction_off_the_lock_keeps_or_releases_the_set(host: HostBackend) -> None:
    store, ledger = _store(host, max_spare_pages=4, handle_pool_pages=1)
    with store:
        with store.lock:
            store.map_locked([1, 2])
        for p, kept in ((1, True), (2, False)):
            with store.lock:
                store.begin_unmap(p)
                assert store.busy == 1 and p not in store.spares
            seconds = store.drive_unmap(p)
            with store.lock:
                handles = store.finish_unmap(p, seconds)
            assert (handles is None) == kept
            if handles is not None:
                store.release_set(handles)
            assert store.busy == 0 and store.state[p] == PageState.UNMAPPED
        assert store.kept_sets == 1 and store.live_sets == 1
        assert _figures(ledger) == {"physical_bytes": LAYERS * G, "mapped_bytes": 0}
    assert host.physical_bytes() == 0


def test_a_begun_map_given_up_after_its_drive_is_unmapped_and_released(host: HostBackend) -> None:
    """A TP rank's page reserved ahead: begun, driven and reported off the lock, then given
    back unpublished (detach, close): the books, the backend and the ledger come back."""
    store, ledger = _store(host, max_spare_pages=1, handle_pool_pages=0)
    with store:
        before = (store.debug_state(), host.debug_state(), _figures(ledger))
        with store.lock:
            jobs = store.begin_map([4], "reserve")
            store.start_off_lock(jobs)
        store.drive_map(jobs)
        with store.lock:
            store.end_off_lock(jobs, 0.001)  # reported: the ledger counts it mapped
        assert _figures(ledger)["mapped_bytes"] == LAYERS * G
        assert store.state[4] == PageState.BUSY and not store.is_mapped(4)  # not published
        with store.lock:
            store.abort_map(jobs)
        assert (store.debug_state(), host.debug_state(), _figures(ledger)) == before


def test_each_party_attaches_once_and_no_mapper_beside_a_tp_group(host: HostBackend) -> None:
    class Party:
        def pages_changed(self, pages: object) -> None:
            pass

        def close(self) -> None:
            pass

        def trim_locked(self) -> None:
            pass

    store, _ = _store(host)
    one, two = Party(), Party()
    with store:
        with store.lock:
            store.attach_user(one)
            with pytest.raises(ValueError, match="already has a user"):
                store.attach_user(two)
            store.detach_user(two)  # not attached: nothing
            assert store.user is one
            store.detach_user(one)
            assert store.user is None
        store.attach_mapper(one)
        with pytest.raises(ValueError, match="already has a background mapper"):
            store.attach_mapper(two)
        with store.lock, pytest.raises(ValueError, match="has a background mapper"):
            store.attach_tp(two)
        store.detach_mapper(one)
        with store.lock:
            store.attach_tp(two)
            with pytest.raises(ValueError, match="already follows a TP group"):
                store.attach_tp(one)
        with pytest.raises(ValueError, match="follows a TP group"):
            store.attach_mapper(one)
        with store.lock:
            assert not store.detach_tp(one) and store.tp is two
            assert store.detach_tp(two) and store.tp is None


def test_debug_state_is_a_copy(host: HostBackend) -> None:
    store, _ = _store(host, max_spare_pages=2)
    with store:
        with store.lock:
            store.map_locked([1])
            store.policy.pin([1])
        st = store.debug_state()
        assert st.state[1] == PageState.MAPPED and st.spares == (1,) and st.pinned == (1,)
        assert st.handles[1] is not None and len(st.handles[1]) == LAYERS
        assert st.unmapped == (0, 2, 3, 4, 5, 6, 7) and st.live_sets == 1 and st.busy == 0
        with store.lock:
            store.set_use(1, True)
        assert store.debug_state().in_use[1] == 1 and st.in_use[1] == 0


def test_a_fence_wait_that_raises_does_not_leave_the_store_half_closed(host: HostBackend) -> None:
    """close() waits for the spares' fences; a wait that raises (CUDA's sync debug mode
    refusing it, a lost context) is counted and the close goes on: every page unmapped,
    every set released, the observer detached so the account can go."""

    class RefusedFence:
        def done(self) -> bool:
            return False

        def wait(self) -> None:
            raise RuntimeError("called a synchronizing CUDA operation")

    store, ledger = _store(host, max_spare_pages=4)
    with store.lock:
        jobs = store.begin_map([1, 3], "map two spares")
    store.drive_map(jobs)
    with store.lock:
        store.end_map(jobs, 0.001)
    store.policy.fence([1, 3], RefusedFence())
    store.close()
    assert store.closed and not any(store.is_mapped(p) for p in range(PAGES))
    assert host.stats()["handles"] == 0 and host.physical_bytes() == 0
    assert store.stats()["driver_failures"] >= 1
    [account] = ledger.accounts()
    ledger.remove_account(account)  # detached: the ledger lets it go
    store.close()  # idempotent
