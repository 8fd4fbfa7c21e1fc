"""The geometry of the RowFollower tests (test_follower, test_packing): 24 KiB rows on 64 KiB
pages, so that rows straddle pages."""

from __future__ import annotations

from allocator.host import HostBackend
from allocator.rows import RowFollower
from allocator.store import PageStore
from tests.allocator.rigs import KIB

GRAN = 64 * KIB
ROW = 24 * KIB  # 8 rows in 3 pages: rows 2 and 5 straddle
ROWS = 64
PAGES = ROWS * ROW // GRAN
LAYERS = 2


def make(host: HostBackend, **options: object) -> tuple[PageStore, RowFollower]:
    store = PageStore(host, layers=LAYERS, page_bytes=GRAN, num_pages=PAGES, **options)  # type: ignore[arg-type]
    return store, RowFollower(store, rows=ROWS, row_bytes=ROW)


def pages_of_rows(rows: list[int]) -> set[int]:
    return {p for r in rows for p in range(r * ROW // GRAN, ((r + 1) * ROW - 1) // GRAN + 1)}


def mapped(store: PageStore) -> set[int]:
    return {p for p in range(PAGES) if store.is_mapped(p)}
