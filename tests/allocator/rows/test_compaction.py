"""allocator.rows.compaction: plans that empty whole pages, sparsest first, into pages in use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from allocator.host import HostBackend
from allocator.rows import RowFollower, compaction, packing
from allocator.store import PageStore
from tests.allocator.rigs import KIB

GRAN = 64 * KIB
ROW = 16 * KIB  # 4 rows per page, none straddling
ROWS = 32  # 8 pages; row 0 (the padding row) holds page 0


@pytest.fixture
def follower() -> Iterator[RowFollower]:
    be = HostBackend(GRAN)
    store = PageStore(
        be, layers=2, page_bytes=GRAN, num_pages=ROWS * ROW // GRAN, max_spare_pages=0
    )
    try:
        yield RowFollower(store, rows=ROWS, row_bytes=ROW)
    finally:
        store.close()
        be.close()


STRADDLING_ROW = 40 * KIB  # 1.6 rows per page: most rows straddle


@contextlib.contextmanager
def straddling(rows: int) -> Iterator[RowFollower]:
    """A follower of `rows` rows of STRADDLING_ROW bytes on one layer, closed after."""
    with HostBackend(GRAN) as be:
        pages = -(-rows * STRADDLING_ROW // GRAN)
        with PageStore(be, layers=1, page_bytes=GRAN, num_pages=pages) as store:
            yield RowFollower(store, rows=rows, row_bytes=STRADDLING_ROW)


def page(row: int) -> int:
    return row * ROW // GRAN


def test_packed_rows_need_no_plan(follower: RowFollower) -> None:
    follower.take([1, 2, 3, 4, 5])
    with follower.store.lock:
        assert compaction.in_use_beyond_packed(follower) == 0
        assert compaction.plan(follower, max_moves=8) == ([], [])


def test_the_sparsest_pages_empty_whole_into_pages_in_use(follower: RowFollower) -> None:
    # page 1: rows 4, 5, 6 (3 rows, one free); page 2: row 8; page 3: rows 12, 13
    follower.take([4, 5, 6, 8, 12, 13])
    with follower.store.lock:
        assert compaction.in_use_beyond_packed(follower) == 2  # 4 in use, 7 rows fill 2
        sources, targets = compaction.plan(follower, max_moves=8)
    assert sources[:1] == [8]  # page 2 first: the sparsest
    assert len(sources) == len(targets) and set(sources).isdisjoint(targets)
    emptied = {page(r) for r in sources}
    assert all(page(t) not in emptied for t in targets)  # never into a page being emptied
    assert all(follower.store.in_use[page(t)] for t in targets)  # into pages in use
    for p in emptied:  # whole pages: every held row of an emptied page moves
        assert {r for r in (4, 5, 6, 8, 12, 13) if page(r) == p} <= set(sources)
    follower.take(targets)
    follower.give_back(sources)
    with follower.store.lock:
        assert compaction.in_use_beyond_packed(follower) < 2


def test_max_moves_and_the_padding_row_are_respected(follower: RowFollower) -> None:
    follower.take([8, 12, 13, 16, 17, 18])
    with follower.store.lock:
        sources, _ = compaction.plan(follower, max_moves=1)
        assert sources == [8]
        everything, _ = compaction.plan(follower, max_moves=32)
    assert 0 not in everything  # row 0 never moves; page 0 is never emptied
    with pytest.raises(ValueError, match="max_moves=0"):
        compaction.plan(follower, max_moves=0)


def test_plans_pair_sources_and_destinations_one_for_one_when_rows_straddle() -> None:
    """Rows straddling two pages: emptying one moves the row out of the other too, which
    then needs no destination of its own. Over random held sets, a plan always pairs every
    source with one destination, moves each row once, and empties whole pages."""
    import random

    rows = 30
    with straddling(rows) as f:
        rng = random.Random(3)
        for _ in range(300):
            held = rng.sample(range(1, rows), rng.randint(1, rows - 2))
            f.take(held)
            with f.store.lock:
                sources, targets = compaction.plan(f, max_moves=rows)
            assert len(sources) == len(targets)
            assert len(set(sources)) == len(sources) and set(sources) <= set(held)
            assert len(set(targets)) == len(targets) and not set(targets) & set(held)
            f.give_back(held)


# -- slide: when no page empties into the others ----------------------------------------------
def test_slide_moves_every_row_beyond_the_packed_pages_inside_them() -> None:
    """Rows straddling pages: a page in use between pages not in use loses its halves, so a
    plan may find nothing to empty while more pages are in use than the rows need. One slide
    with room for every move leaves each held row inside the packed pages, and no more pages
    in use than those; over random held sets."""
    import random

    rows = 40
    with straddling(rows) as f:
        store, row = f.store, STRADDLING_ROW
        rng = random.Random(7)
        for _ in range(200):
            held = rng.sample(range(1, rows), rng.randint(1, rows // 2))
            f.take(held)
            with store.lock:
                packed = packing.packed_pages(f)
                end = packed * GRAN // row
                sources, targets = compaction.slide(f, max_moves=rows)
                assert sorted(sources) == sorted(r for r in held if r >= end)
                assert len(targets) == len(sources) and all(1 <= t < end for t in targets)
                assert not set(targets) & set(held)
            f.take(targets)  # maps the gaps
            f.give_back(sources)
            with store.lock:
                assert compaction.in_use_beyond_packed(f) <= 0
                assert compaction.slide(f, max_moves=rows) == ([], [])
            f.give_back_all()


def test_slide_fills_holes_first_and_moves_whole_pages_within_max_moves(
    follower: RowFollower,
) -> None:
    # page 0 full (rows 0-3), page 1 rows 5-7 (row 4 free), page 3 row 13, page 7 rows 29-30:
    # 9 rows and the padding row pack into pages 0-2 (rows 0..11); page 2 is a gap
    follower.take([1, 2, 3, 5, 6, 7, 13, 29, 30])
    with follower.store.lock:
        assert packing.packed_pages(follower) == 3
        sources, targets = compaction.slide(follower, max_moves=8)
        assert sources == [29, 30, 13]  # the highest page first, each page whole
        assert targets == [4, 8, 9]  # the hole in page 1, then the gap in address order
        assert not follower.store.is_mapped(2)  # the gap: taking row 8 maps it
        two, _ = compaction.slide(follower, max_moves=2)
        assert two == [29, 30]  # page 3's row would pass max_moves: it waits
        with pytest.raises(ValueError, match="max_moves=0"):
            compaction.slide(follower, max_moves=0)
