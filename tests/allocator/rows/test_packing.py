"""allocator.rows.packing: the order an engine should hand out a follower's free rows in, and
whether the held rows sit on more pages than they need."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from allocator.host import HostBackend
from allocator.rows import packing
from tests.allocator.rows.rig import GRAN, ROWS, make, mapped, pages_of_rows


@pytest.fixture
def host() -> Iterator[HostBackend]:
    be = HostBackend(GRAN)
    yield be
    be.close()


def test_pack_order_puts_rows_of_the_fullest_mapped_pages_first(host: HostBackend) -> None:
    """Packing: of an engine's free rows, those whose pages hold the most rows come first,
    then those lying in mapped spare pages, then the rest, ascending within each;
    `fragmented` says when more pages are mapped than the held rows need."""
    store, f = make(host, max_spare_pages=1)
    with store:
        assert not packing.fragmented(f)  # the padding row's page only
        # 24 KiB rows on 64 KiB pages: rows 8, 9, 10 in page 3 (10 straddles into 4), row
        # 16 alone in page 6, rows 40 and 41 exactly page 15.
        f.take([8, 9, 10, 16, 40, 41])
        f.give_back([40, 41])  # page 15 becomes the one spare kept
        assert packing.fragmented(f)  # pages 0, 3, 4, 6, 15 mapped for four rows
        free = np.array([60, 45, 11, 17, 12, 42, 5, 43, 41], dtype=np.int64)
        # 17 shares page 6 with a whole row; 11 and 12 page 4 with a straddling one; 41 is in
        # the mapped spare; the rest touch an unmapped page (42 straddles into page 16).
        assert packing.pack_order(f, free).tolist() == [17, 11, 12, 41, 5, 42, 43, 45, 60]


def test_pack_keys_put_the_fullest_mapped_pages_first(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=4)
    with store:
        f.take([9, 10, 11])  # page 3 (rows 8-10) and page 4 in use
        with store.lock:
            store.map_locked([7])  # a spare
        order = packing.pack_order(f, np.array([30, 13, 19, 8, 12, 20], np.int64))
        # free rows of the pages in use first, then rows of the mapped spare (page 7), then
        # rows touching an unmapped page, even row 13, which straddles page 4 (in use) and
        # page 5 (not mapped): handed out early it would need a map
        assert order.tolist() == [8, 12, 19, 20, 13, 30]


def test_mapped_free_rows_counts_free_rows_whose_pages_are_all_mapped(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=4)
    with store:
        f.take([1, 2])
        mapped_rows = [r for r in range(1, ROWS) if pages_of_rows([r]) <= mapped(store)]
        assert packing.mapped_free_rows(f) == len(mapped_rows) - 2
        f.give_back([2])  # page 1 stays mapped (a spare): row 2 still counts
        assert packing.mapped_free_rows(f) == len(mapped_rows) - 1


def test_over_bound_soon_counts_the_spares_the_mapper_may_still_map(host: HostBackend) -> None:
    """Pages in use two beyond packed and no spare mapped: within the bound now, over it once
    the mapper maps the two spares the watermark allows, which `over_bound_soon` says first."""
    store, f = make(host, max_spare_pages=2)
    with store:
        # rows 8, 16, 40 alone in pages 3, 6, 15; the padding row in page 0: four pages in
        # use for rows packed into two
        f.take([8, 16, 40])
        assert packing.packed_pages(f) == 2 and packing.packing_bound(f) == 5
        assert len(mapped(store)) == 4 and not store.spares
        assert packing.spares_to_come(f) == 2
        assert not packing.fragmented(f)
        assert packing.over_bound_soon(f)
        with store.lock:
            store.map_locked([20, 21])  # what the mapper maps ahead next
        assert packing.spares_to_come(f) == 0
        assert packing.fragmented(f) and packing.over_bound_soon(f)
        f.give_back([40])  # page 15 a spare: three spares, one over the watermark
        assert packing.spares_to_come(f) == 0
        assert packing.fragmented(f) == packing.over_bound_soon(f)


def test_over_bound_soon_is_fragmented_once_the_spares_are_mapped(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=1)
    with store:
        f.take([8, 9, 10])  # pages 0, 3, 4 in use for rows packed into two
        assert not packing.fragmented(f) and not packing.over_bound_soon(f)
        f.take([16])  # page 6: one more in use, within the bound, but not with a spare
        assert not packing.fragmented(f) and packing.over_bound_soon(f)


def test_at_the_watermark_a_stale_spare_leaves_room_for_one_mapped_ahead(host: HostBackend) -> None:
    """A stale spare at the watermark: the mapper may map a page wanted ahead in its place
    before trimming it, one spare beyond the watermark meanwhile; counted as to come."""
    store, f = make(host, max_spare_pages=1)
    with store:
        f.take([8, 9, 10])
        with store.lock:
            store.map_locked([20])  # a spare, stale: neither pinned nor wanted ahead
            assert packing.spares_to_come(f) == 0
            store.policy.set_ahead([22])  # a page wanted ahead, not mapped: it may take 20's place
            assert packing.spares_to_come(f) == 1
            store.policy.pin([20])  # pinned, 20 is not stale: no room for 22
            assert packing.spares_to_come(f) == 0
