"""Compaction plans: which held rows of a `RowFollower` to move where, so that sparse pages
empty and can be unmapped.

Packing (the engine's free-list order) decides where new rows go, never where held rows
are: after finishes at random, the survivors stay scattered over many pages, each mapped
while any one of its rows lives. Moving rows is the engine's business (its indices point
at them); this module only says which moves would empty pages: `plan` returns held rows
(sources) and free rows (destinations), one for one, such that

- every page a source leaves is emptied whole (a plan never half-empties a page: that would
  move bytes for nothing), the sparsest pages first;
- every destination lies in pages that are in use, mapped and not being emptied, the
  fullest first (so nothing is mapped, and every page a plan empties is one page fewer in
  use: a plan cannot go round in circles);
- the rows below `first_row` (an engine's padding row) and their pages stay.

That plan cannot always empty a page when held rows are scattered: a row straddles two
pages, so a page in use between pages not in use holds one row fewer than its share, and
the free rows left in the pages in use may all be such unusable halves. `slide` is then
the way out: it moves the held rows of the highest pages down into free rows of the lowest
pages (where the held rows, packed, would lie), whole pages at a time, mapping the low
pages it needs; repeated, it leaves every held row inside the fewest pages that can hold
them.

The SGLang bridge applies a plan with `kvledger.engines.sglang.bridge.compact`. See
docs/allocator.md#compaction.
"""

from __future__ import annotations

import numpy as np

from allocator.checks import check_count
from allocator.rows.follower import RowFollower
from allocator.rows.packing import packed_pages
from allocator.states import PageState


def in_use_beyond_packed(f: RowFollower) -> int:
    """Pages in use beyond what the held rows (and the padding row) would fill packed."""
    return f.store.in_use.count(1) - packed_pages(f)


def slide(f: RowFollower, *, max_moves: int) -> tuple[list[int], list[int]]:
    """(sources, destinations) for at most `max_moves` moves: the held rows of the highest
    pages whose rows lie beyond the first `packed_pages(f)` pages, whole pages first, onto
    the free rows inside those pages, the holes of pages in use first, then the others in
    address order (taking them maps the pages not mapped). Empty when every held row
    lies inside already. Call under the store's lock, with the follower up to date."""
    check_count("max_moves", max_moves, 1)
    end = packed_pages(f) * f.store.page_bytes // f.row_bytes  # rows below lie inside
    held = np.frombuffer(f.held_flags, np.uint8).astype(bool)
    above = np.flatnonzero(held[end:]) + end
    if not above.size:
        return [], []
    last = f.row_pages[:, 1]
    sources: list[int] = []
    for p in np.unique(last[above])[::-1].tolist():  # the highest pages first, whole
        movers = above[last[above] == p].tolist()
        if sources and len(sources) + len(movers) > max_moves:
            break
        sources += movers
    sources = sources[:max_moves]
    in_use = np.frombuffer(f.store.in_use, np.uint8)
    free = np.flatnonzero(~held[:end])
    free = free[free >= f.first_row]
    pages = f.row_pages[free]
    # The holes in pages in use first; then the other free rows in address order, so each
    # page brought into use fills whole (scattered, every one would cost a page).
    gap = (in_use[pages[:, 0]] == 0) | (in_use[pages[:, 1]] == 0)
    targets = np.concatenate([free[~gap], free[gap]])[: len(sources)].tolist()
    return sources[: len(targets)], targets


def plan(f: RowFollower, *, max_moves: int) -> tuple[list[int], list[int]]:
    """(sources, destinations) for at most `max_moves` moves; empty when no page can be
    emptied into the other pages in use. Call under the store's lock, with the follower up
    to date."""
    check_count("max_moves", max_moves, 1)
    store = f.store
    first, last = f.row_pages[:, 0], f.row_pages[:, 1]
    held = np.frombuffer(f.held_flags, np.uint8).astype(bool)
    n = store.num_pages
    occupancy = np.bincount(first[held], minlength=n) + np.bincount(
        last[held & (last != first)], minlength=n
    )
    state = np.frombuffer(store.state, np.uint8)
    fixed = {int(p) for r in range(f.first_row) for p in (first[r], last[r])}
    free = np.flatnonzero(~held)
    free = free[free >= f.first_row]
    usable = (
        (occupancy[first[free]] > 0)
        & (occupancy[last[free]] > 0)
        & (state[first[free]] == PageState.MAPPED)
        & (state[last[free]] == PageState.MAPPED)
    )
    dest = free[usable]
    dest_fill = np.minimum(occupancy[first[dest]], occupancy[last[dest]])
    dest = dest[np.argsort(-dest_fill, kind="stable")].tolist()  # fullest pages first
    f0, l0 = first.tolist(), last.tolist()
    sources: list[int] = []
    targets: list[int] = []
    emptying: set[int] = set()
    dest_pages: set[int] = set()
    taken: set[int] = set()
    order = np.argsort(occupancy, kind="stable").tolist()  # sparsest first
    for p in order:
        if not occupancy[p] or p in fixed or p in dest_pages:
            continue
        movers = [
            r
            for r in np.flatnonzero(held & ((first == p) | (last == p))).tolist()
            if r not in sources
        ]
        if not movers:  # its rows move already (they straddle a page emptied before)
            emptying.add(p)
            continue
        if len(sources) + len(movers) > max_moves:
            break
        chosen: list[int] = []
        for d in dest:
            if d in taken or f0[d] in emptying or l0[d] in emptying or p in (f0[d], l0[d]):
                continue
            chosen.append(d)
            if len(chosen) == len(movers):
                break
        if len(chosen) < len(movers):
            break  # the next pages hold more rows still: they will not fit either
        emptying.add(p)
        sources += movers
        targets += chosen
        taken.update(chosen)
        dest_pages.update(q for d in chosen for q in (f0[d], l0[d]))
    return sources, targets
