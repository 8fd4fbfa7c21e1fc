"""The front: what an engine hands out next, as the page store must see it.

An engine that takes rows from the front of its free list (SGLang's paged allocator) can be
handed rows before the follower (allocator.rows) hears of them, as long as their pages are
mapped and stay so. `plan` reads the first rows of that list against the store's page
states and the follower's per-page counts and says how far the engine may go without a map
(the rows to pin), which pages to map ahead, and when to look again. A pure function of
arrays the follower owns; `RowFollower.front` calls it under the store's lock. See
docs/allocator.md#map-ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from allocator.states import PageState


class Front(NamedTuple):
    safe: int  # rows that can be handed out without a map
    pinned: list[int]  # the pages of those rows (to pin)
    ahead: list[int]  # the pages to map ahead, in order of first use
    warm: int  # rows before the first that touches a page not in use


def plan(
    first: Sequence[int],
    last: Sequence[int],
    count: Sequence[int],
    state: Sequence[int],
    rows: list[int],
    max_spares: int,
    ahead: int,
    ahead_spares: int | None = None,
    min_rows: int = 0,
) -> Front:
    """For `rows` an engine hands out next, in order, with `first[row]` and `last[row]` the
    pages of a row's first and last byte, `count[page]` non-zero while a page is in use and
    `state[page]` its store state:

    - `safe`: how many can be handed out without a map (the longest prefix whose pages are
      all mapped, touching at most `max_spares` pages not in use);
    - `pinned`: the pages of that prefix, and the first page of the row that ends it when
      that page passes the same test (the row straddles into a page that does not). That
      page is the next allocation's, and pinned it stays mapped rather than trimmed as a
      spare just before it is wanted (docs/allocator.md#map-ahead has the runs);
    - `ahead`: the pinned pages, then those of the first max(`ahead`, `safe`) rows in
      order of first use,
      stopping past the prefix where they would hold more than `ahead_spares` pages not in
      use (None: no cap), so that what is mapped ahead and never handed out stays within
      that, except that the first `min_rows` rows are always covered (twice the most the
      engine takes in one call);
    - `warm`: how many rows come before the first that touches a page not in use (handing
      that one out is when the page after it should be mapped ahead).

    A loop that stops at the first row it cannot take: a few dozen rows in practice."""
    mapped = PageState.MAPPED
    pages: dict[int, None] = {}
    spares = 0
    safe = warm = len(rows)
    for i, row in enumerate(rows):
        for q in (first[row], last[row]):
            if q in pages:
                continue
            if state[q] != mapped or (not count[q] and spares == max_spares):
                break  # unmapped, or one spare too many
            if not count[q] and not spares:
                warm = i
            spares += not count[q]
            pages[q] = None  # the stopping row's first page too, when it passes
        else:
            continue
        safe = i
        break
    warm = min(warm, safe)
    pinned = list(pages)
    if safe >= ahead:
        return Front(safe, pinned, pinned, warm)
    cap = None if ahead_spares is None else max(ahead_spares, spares)
    for i in range(safe, min(ahead, len(rows))):
        row = rows[i]
        new = [q for q in dict.fromkeys((first[row], last[row])) if q not in pages]
        unused = sum(1 for q in new if not count[q])
        if cap is not None and spares + unused > cap and i >= min_rows:
            break
        spares += unused
        pages.update(dict.fromkeys(new))
    return Front(safe, pinned, list(pages), warm)
