"""Packing: the order in which an engine should hand out a `RowFollower`'s free rows, and
whether its held rows sit on more pages than they need.

The engine's free-list order decides which VMM pages new rows land on. Handed out in
`pack_keys` order (the SGLang bridge reorders SGLang's free list by it:
kvledger.engines.sglang.bridge.allocator_hooks), new rows fill the fullest mapped pages first, then mapped
spares, and only then pages that need a map, so sparse pages empty and unmap. A free row
that straddles a page in use and a page not mapped goes with the latter: handed out early
it would need a map. See docs/allocator.md#packing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from allocator.rows.follower import RowFollower, as_rows
from allocator.states import PageState


def packed_pages(f: RowFollower) -> int:
    """The fewest pages the held rows and the padding rows fit in (rows 0 .. held)."""
    return -(-((f.held_rows + f.first_row) * f.row_bytes) // f.store.page_bytes)


def packing_bound(f: RowFollower) -> int:
    """The page ids the held rows may keep mapped: packed, plus the spares kept, plus one."""
    return packed_pages(f) + f.store.policy.max_spare_pages + 1


def fragmented(f: RowFollower) -> bool:
    """More page ids mapped than the held rows need packed, beyond the spares and one."""
    return f.store.state.count(PageState.MAPPED) > packing_bound(f)


def spares_to_come(f: RowFollower) -> int:
    """The spares the background mapper may still map ahead: up to the watermark
    (`max_spare_pages`) from the spares mapped now; at the watermark, one while a page wanted
    ahead may take a stale spare's place (mapped first, the stale one trimmed after its
    grace: allocator.spares). A page it is mapping now counts here, not as mapped."""
    policy = f.store.policy
    n, watermark = len(f.store.spares), policy.max_spare_pages
    if n < watermark:
        return watermark - n
    return int(n == watermark and policy.map_target() is not None)


def over_bound_soon(f: RowFollower) -> bool:
    """`fragmented` once the mapper has mapped ahead all the spares the watermark allows: the
    pages in use beyond packed leave no room for them. Checked alone, `fragmented` lets the
    pages in use sit two beyond packed while few spares are mapped, and a map ahead right
    after the check takes the mapped page ids over the bound (docs/benchmarks.md)."""
    mapped = f.store.state.count(PageState.MAPPED)
    return mapped + spares_to_come(f) > packing_bound(f)


def _mapped(f: RowFollower) -> np.ndarray:
    """Per row, whether both its pages are mapped."""
    # Per page first (a few dozen), then gathered per row; against the int, not the
    # PageState member, which numpy compares through its generic path (several us a call).
    mapped = np.frombuffer(f.store.state, np.uint8) == int(PageState.MAPPED)
    p = f.row_pages
    return mapped[p[:, 0]] & mapped[p[:, 1]]


def mapped_free_rows(f: RowFollower) -> int:
    """Rows not held whose pages are all mapped (the padding rows excluded)."""
    free = np.frombuffer(f.held_flags, np.uint8) == 0
    free[: f.first_row] = False
    return int(np.count_nonzero(free & _mapped(f)))


def pack_keys(f: RowFollower) -> np.ndarray:
    """A sort key per row for packing: ascending, the rows whose pages are all mapped first,
    the rows whose pages hold the most rows first among them (then rows of mapped spare
    pages), then the rows touching a page not mapped (a row straddling a page in use and
    one not mapped among them); by row within each."""
    p, count = f.row_pages, f.page_counts
    occupancy = count[p[:, 0]] + count[p[:, 1]]
    top = int(occupancy.max()) + 1
    rank = (~_mapped(f)).astype(np.int64) * (top + 1) + (top - occupancy)
    return rank * f.rows + np.arange(f.rows, dtype=np.int64)


def pack_order(f: RowFollower, free: Any) -> np.ndarray:
    """`free` (an engine's free rows) in packing order (`pack_keys`)."""
    rows = as_rows(free)
    return rows[np.argsort(pack_keys(f)[rows], kind="stable")]
