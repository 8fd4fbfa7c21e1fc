"""RowFollower on a page store: fences (a page is never unmapped while GPU work may use it),
unmap hysteresis, map-ahead (no take waits on the driver) and the release of everything."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from allocator.host import HostBackend
from allocator.mapper import BackgroundMapper
from allocator.store import PageStore
from tests.allocator.rows.rig import GRAN, LAYERS, PAGES, ROW, ROWS, make, mapped, pages_of_rows


class FakeFence:
    """A device fence stand-in: not done until `signal()`; `wait()` blocks until then, as a
    device synchronisation blocks until the queued kernels have run."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.waited = 0

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self.waited += 1
        assert self._event.wait(10), "nobody signalled the fence"

    def signal(self) -> None:
        self._event.set()


@pytest.fixture
def host() -> Iterator[HostBackend]:
    be = HostBackend(GRAN)
    yield be
    be.close()


def every_layer_mapped(host: HostBackend, store: PageStore, page: int) -> bool:
    return all(host.is_mapped(store.address(layer, page)) for layer in range(LAYERS))


def test_take_and_give_back_follow_rows_onto_pages(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=0, handle_pool_pages=0)
    with store:
        assert mapped(store) == pages_of_rows([0])
        assert f.take(np.array([9, 10, 11])) == 3
        assert mapped(store) == pages_of_rows([0, 9, 10, 11])
        assert f.give_back([10]) == 1
        assert mapped(store) == pages_of_rows([0, 9, 11])  # row 10's page still has 9 and 11
        f.give_back([9, 11])
        assert mapped(store) == pages_of_rows([0])
        assert store.stats()["occupied_slots"] == 0 and f.held_rows == 0
    assert host.stats()["handles"] == 0 and host.physical_bytes() == 0


def test_a_page_is_not_unmapped_before_its_fence_signals(host: HostBackend) -> None:
    """The CUDA rule on the CPU: a page given back under an unsignalled fence stays mapped
    (a kernel may still read it; unmapping would fault); it goes once the fence is done."""
    store, f = make(host, max_spare_pages=0, handle_pool_pages=0)
    with store:
        f.take([20, 21])
        page = 20 * ROW // GRAN
        fence = FakeFence()
        f.give_back([20, 21], fence)
        assert store.is_mapped(page) and every_layer_mapped(host, store, page)
        f.take([40])  # more traffic: still not unmapped
        f.give_back([40])
        assert store.is_mapped(page)
        fence.signal()
        f.take([41])
        f.give_back([41])  # the next release finds the fence done
        assert not store.is_mapped(page) and not every_layer_mapped(host, store, page)


def test_the_mapper_waits_for_fences_too(host: HostBackend) -> None:
    """The mapper waits on a fenced spare's fence (off the allocating thread) and unmaps it
    only once that returned."""
    store, f = make(host, max_spare_pages=0, handle_pool_pages=0)
    with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
        f.take([30])
        page = 30 * ROW // GRAN
        fence = FakeFence()
        f.give_back([30], fence)
        time.sleep(0.1)
        assert fence.waited == 1  # the mapper is waiting on it...
        assert store.is_mapped(page)  # ...and has not unmapped the page
        fence.signal()
        assert mapper.wait_idle()
        assert not store.is_mapped(page) and not every_layer_mapped(host, store, page)


def test_close_waits_for_pending_fences(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=0)
    f.take([12])
    fence = FakeFence()
    f.give_back([12], fence)
    threading.Timer(0.1, fence.signal).start()
    t0 = time.monotonic()
    store.close()
    assert fence.waited == 1 and time.monotonic() - t0 >= 0.09
    assert host.stats()["mappings"] == 0


def test_unmap_hysteresis_keeps_a_refilled_page_mapped(host: HostBackend) -> None:
    """With a grace, a page emptied and refilled within it is neither unmapped nor mapped
    again; one that stays empty longer is unmapped by the next release."""
    store, f = make(host, max_spare_pages=0, handle_pool_pages=0, unmap_grace_s=0.2)
    with store:
        f.take([30])
        maps = store.stats()["pages_mapped_total"]
        for _ in range(20):  # a finish and an admission reusing the row, again and again
            f.give_back([30])
            f.take([30])
        stats = store.stats()
        assert stats["pages_mapped_total"] == maps and stats["pages_unmapped_total"] == 0
        f.give_back([30])
        page = 30 * ROW // GRAN
        assert store.is_mapped(page)  # within the grace
        time.sleep(0.25)
        f.take([50])
        f.give_back([50])  # past the grace: the spares beyond the watermark go
        assert not store.is_mapped(page)


def test_unmap_hysteresis_is_bounded_in_count(host: HostBackend) -> None:
    """A release that empties many pages at once keeps at most max_spare_pages + grace_pages
    of them mapped, even within the grace; the rest are unmapped before it returns."""
    store, f = make(host, max_spare_pages=1, grace_pages=1, unmap_grace_s=60.0)
    with store:
        rows = list(range(8, 40))  # pages 3..14: twelve pages
        f.take(rows)
        in_use = len(pages_of_rows(rows))
        assert store.stats()["mapped_pages"] == in_use + 1  # + the padding row's page 0
        f.give_back(rows)  # every page of them emptied at once
        s = store.stats()
        assert s["spare_pages"] == 2  # max_spare_pages + grace_pages, grace far from over
        assert s["mapped_pages"] == 1 + 2 and s["pages_unmapped_total"] == in_use - 2
        assert host.stats()["mappings"] == LAYERS * 3


def test_no_grace_pages_keeps_only_the_watermark(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=1, grace_pages=0, unmap_grace_s=60.0)
    with store:
        f.take(list(range(8, 40)))
        f.give_back(list(range(8, 40)))
        assert store.stats()["spare_pages"] == 1


def test_grace_pages_must_be_a_count(host: HostBackend) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="grace_pages"):
            PageStore(host, layers=LAYERS, page_bytes=GRAN, num_pages=PAGES, grace_pages=bad)  # type: ignore[arg-type]
    assert host.stats()["mappings"] == 0


def test_rows_announced_ahead_are_mapped_before_they_are_taken(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=3)
    with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
        ahead = list(range(16, 24))
        f.ahead(ahead)
        assert mapper.wait_idle()
        assert pages_of_rows(ahead) <= mapped(store)
        f.take(ahead)
        assert f.waited == 0  # no take waited on the driver
        f.take([60])  # not announced: mapped on the spot
        assert f.waited == 1


@pytest.mark.parametrize("grace", [0.0, 0.05])
def test_a_page_wanted_ahead_takes_the_place_of_a_stale_spare(
    host: HostBackend, grace: float
) -> None:
    """Spares at the watermark that the engine will not hand out next (its free list was
    sorted or packed away from them) do not keep the page it will hand out unmapped: the
    mapper maps that one and trims a stale one behind it, never the wanted one."""
    store, f = make(host, max_spare_pages=2, unmap_grace_s=grace)
    with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
        f.take(list(range(8, 16)), count_waits=False)  # pages 3, 4, 5
        f.give_back(list(range(8, 16)))
        assert mapper.wait_idle()
        stale = set(store.spares)
        assert len(stale) == 2 and stale <= {3, 4, 5}
        wanted = pages_of_rows([40])  # page 15
        assert not wanted & mapped(store)
        f.ahead([40])
        assert mapper.wait_idle()
        assert wanted <= mapped(store)
        assert len(store.spares) == 2 and len(set(store.spares) & stale) == 1
        f.take([40])
        assert f.waited == 0


def test_a_wanted_page_is_not_trimmed_while_the_stale_spares_wait_for_their_fence(
    host: HostBackend,
) -> None:
    """On CUDA the stale spares are fenced (GPU work may still use them). While their fence
    has not signalled, the page mapped in a stale one's place must stay: trimming it instead
    (the only spare not fenced) has the mapper map and unmap it in a loop until the fence
    signals."""
    store, f = make(host, max_spare_pages=2, unmap_grace_s=0.0)
    with store, BackgroundMapper(store, idle_seconds=0.01) as mapper:
        f.take(list(range(8, 13)), count_waits=False)  # pages 3 and 4
        fence = FakeFence()
        f.give_back(list(range(8, 13)), fence)
        assert mapper.wait_idle()
        assert set(store.spares) == {3, 4}
        maps = store.stats()["pages_mapped_total"]
        f.ahead([40])  # page 15
        deadline = time.monotonic() + 5
        while not store.is_mapped(15) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # long enough for the loop to run thousands of times
        assert store.is_mapped(15)
        assert store.stats()["pages_mapped_total"] == maps + 1  # mapped once, not in a loop
        assert store.stats()["pages_unmapped_total"] == 0
        fence.signal()
        assert mapper.wait_idle()
        assert store.is_mapped(15) and len(store.spares) == 2 and 15 in store.spares
        f.take([40])
        assert f.waited == 0


def test_give_back_all_and_held(host: HostBackend) -> None:
    store, f = make(host)
    with store:
        f.take([7, 3, 50])
        assert f.held().tolist() == [3, 7, 50]
        assert f.pages_of([3]) == sorted(pages_of_rows([3]))
        assert f.give_back_all() == 3 and f.held().tolist() == []


def test_the_scalar_and_vectorised_paths_keep_the_same_books(host: HostBackend) -> None:
    """Random takes and give-backs of 1..2*SMALL rows (both paths of RowFollower, mixed):
    after each, the page counts equal those recounted from the held rows, exactly the pages
    of held rows are in use, and each of them is mapped."""
    from allocator.rows import SMALL

    rng = np.random.default_rng(13)
    store, f = make(host, max_spare_pages=2)
    held: set[int] = set()
    with store:
        for _ in range(400):
            free = sorted(set(range(1, ROWS)) - held)
            if free and (not held or rng.random() < 0.5):
                n = int(rng.integers(1, min(len(free), 2 * SMALL) + 1))
                rows = rng.choice(free, n, replace=False)
                assert f.take(rows) == n
                held |= set(rows.tolist())
            else:
                n = int(rng.integers(1, min(len(held), 2 * SMALL) + 1))
                rows = rng.choice(sorted(held), n, replace=False)
                assert f.give_back(rows) == n
                held -= set(rows.tolist())
            want = np.bincount(f.row_pages[[0, *sorted(held)]].ravel(), minlength=store.num_pages)
            assert np.array_equal(f.page_counts, want)
            used = pages_of_rows([0, *held])
            assert {p for p in range(PAGES) if store.in_use[p]} == used
            assert used <= mapped(store)
            assert f.held_rows == len(held) and f.divergences == 0


def test_a_row_twice_in_one_small_call_is_applied_once_and_counted(host: HostBackend) -> None:
    """(A duplicate in a call of more than SMALL rows is caught by the count check.)"""
    store, f = make(host)
    with store:
        size = 5
        rows = [*range(10, 10 + size - 1), 10]  # row 10 twice
        assert f.take(rows) == size - 1
        assert f.held_rows == size - 1 and f.divergences == 1
        assert f.give_back(rows) == size - 1
        assert f.held_rows == 0 and f.divergences == 2


def test_a_row_twice_in_a_long_call_is_caught_by_the_count_check(
    host: HostBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A call of more than SMALL rows takes the vectorised path, which leaves duplicates to
    the count check every REPORT_EVERY calls: it counts them and rebuilds the page counts."""
    from allocator.reporting import REPORT_EVERY
    from allocator.rows import SMALL

    store, f = make(host)
    with store:
        rows = [*range(10, 10 + SMALL + 1), 10]
        f.take(rows)
        for _ in range(REPORT_EVERY):
            f.take([60])
            f.give_back([60])
        assert f.divergences == 1 and "taken twice" in caplog.text
        assert f.held_rows == SMALL + 1
        f.give_back(rows[:-1])
        assert f.held_rows == 0 and mapped(store) <= {0} | set(store.spares)


# -- what the SGLang bridge's journal asks of the follower --------------------------------------
def test_front_pins_mapped_rows_up_to_the_spare_limit(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=1)
    with store:
        f.take([1, 2])  # pages 0 and 1 (row 2 straddles) in use
        with store.lock:
            store.map_locked([2, 3])  # two spares
            # rows 3..: row 3-4 in page 1, row 5 straddles 1-2, rows 6-7 in page 2, 8 in 3
            safe, pinned, ahead, warm = f.front([3, 4, 5, 6, 7, 8, 9], max_spares=1, ahead=7)
        assert safe == 5  # row 8 would touch a second page not in use (page 3)
        assert warm == 2  # row 5 is the first to touch a page not in use (page 2)
        assert pinned == [1, 2]
        assert set(ahead) >= {1, 2, 3}
        with store.lock:
            safe0, pinned0, _, warm0 = f.front([3, 4, 5], max_spares=0, ahead=0)
        assert safe0 == warm0 == 2 and pinned0 == [1]  # row 5 reaches page 2, a spare
        with store.lock:
            unmapped, _, _, cold = f.front([30, 3], max_spares=4, ahead=0)
        assert unmapped == cold == 0  # row 30's page is not mapped


def test_ahead_pages_stop_at_the_cap_of_pages_not_in_use(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=1)
    with store:
        f.take([1, 2])  # pages 0 and 1 in use
        with store.lock:
            store.map_locked([2])  # one spare, in the safe prefix
            rows = list(range(3, 20))
            safe, pinned, capped, _ = f.front(rows, max_spares=1, ahead=16, ahead_spares=1)
            _, _, two, _ = f.front(rows, max_spares=1, ahead=16, ahead_spares=2)
            _, _, free, _ = f.front(rows, max_spares=1, ahead=16)
        assert safe == 5 and pinned == [1, 2]
        assert capped == [1, 2]  # page 2 is the one page not in use the cap allows
        assert two == [1, 2, 3]  # one more: row 8's page
        with store.lock:
            _, _, wide, _ = f.front(rows, max_spares=1, ahead=16, ahead_spares=1, min_rows=6)
        assert wide == [1, 2, 3]  # rows 3..8 covered whatever the cap: row 8's page too
        assert free == sorted(pages_of_rows(rows[:16])) and len(free) > len(two)


def test_pinned_spares_are_never_trimmed(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=0, grace_pages=0)
    with store:
        f.take([20, 30])
        keep = sorted(pages_of_rows([20]))
        with store.lock:
            store.policy.pin(keep)
        f.give_back([20, 30])  # both emptied: spares beyond the limit of 0
        assert all(store.is_mapped(p) for p in keep)
        assert not any(store.is_mapped(p) for p in pages_of_rows([30]) - set(keep))
        with store.lock:
            store.policy.pin([])
            store.policy.trim_locked()
        assert not any(store.is_mapped(p) for p in keep)


def test_cover_maps_without_taking_and_counts_the_wait(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=4)
    with store:
        with store.lock:
            pages = f.cover([40, 41])
        assert pages == sorted(pages_of_rows([40, 41])) and all(store.is_mapped(p) for p in pages)
        assert f.held_rows == 0 and f.waited == 1
        with store.lock:
            f.cover([40])  # mapped already: no wait
        assert f.waited == 1


def test_a_take_that_is_no_allocation_maps_without_counting_a_wait(host: HostBackend) -> None:
    from allocator.rows import SMALL

    store, f = make(host, max_spare_pages=0)
    with store:
        f.take([30], count_waits=False)  # a compaction's destination: mapped, not a wait
        many = list(range(31, 31 + SMALL + 1))  # the vectorised path too
        f.take(many, count_waits=False)
        assert mapped(store) >= pages_of_rows([30, *many]) and f.waited == 0
        f.take([10])  # an allocation that had to map its page: one wait
        assert f.waited == 1
