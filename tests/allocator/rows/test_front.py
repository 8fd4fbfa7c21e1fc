"""allocator.rows.front.plan on arrays built by hand and at random, against the definitions in
its docstring written out the slow way."""

from __future__ import annotations

import random

from allocator.rows.front import Front, plan
from allocator.states import PageState

MAPPED, UNMAPPED = PageState.MAPPED, PageState.UNMAPPED


class Slow:
    """The definitions of `plan`'s docstring over the same four arrays, the slow way."""

    def __init__(
        self, first: list[int], last: list[int], count: list[int], state: list[int]
    ) -> None:
        self.first, self.last, self.count, self.state = first, last, count, state

    def in_order(self, rows: list[int]) -> list[int]:
        return list(dict.fromkeys(q for r in rows for q in (self.first[r], self.last[r])))

    def safe(self, rows: list[int], max_spares: int) -> int:
        """The longest prefix of `rows` whose pages are all mapped, with at most `max_spares`
        distinct pages not in use."""
        best = 0
        for n in range(len(rows) + 1):
            pages = set(self.in_order(rows[:n]))
            if any(self.state[q] != MAPPED for q in pages):
                break
            if sum(1 for q in pages if not self.count[q]) > max_spares:
                break
            best = n
        return best

    def pinned(self, rows: list[int], max_spares: int, safe: int) -> list[int]:
        """The pages of the prefix, then the first page of the row that ends it if that page
        is mapped and, when not in use, within the spares."""
        pinned = self.in_order(rows[:safe])
        if safe < len(rows):
            q = self.first[rows[safe]]
            spares = sum(1 for p in pinned if not self.count[p])
            if (
                q not in pinned
                and self.state[q] == MAPPED
                and (self.count[q] or spares < max_spares)
            ):
                pinned.append(q)
        return pinned

    def warm(self, rows: list[int], safe: int) -> int:
        for i, r in enumerate(rows):
            if not self.count[self.first[r]] or not self.count[self.last[r]]:
                return min(i, safe)
        return min(len(rows), safe)


def test_a_hand_built_front() -> None:
    # rows 0..5 over pages 0..3: row 2 straddles pages 1-2
    first = [0, 1, 1, 2, 3, 3]
    last = [0, 1, 2, 2, 3, 3]
    count = [1, 1, 0, 0]  # pages 0 and 1 in use
    state = [MAPPED, MAPPED, MAPPED, UNMAPPED]
    f = plan(first, last, count, state, [0, 1, 2, 3, 4, 5], max_spares=1, ahead=6)
    assert f == Front(safe=4, pinned=[0, 1, 2], ahead=[0, 1, 2, 3], warm=2)
    # no spare allowed: stops at row 2 (it reaches page 2, not in use)
    assert plan(first, last, count, state, [0, 1, 2], max_spares=0, ahead=0).safe == 2
    # capped: what is mapped ahead holds at most one page not in use, unless min_rows says
    capped = plan(first, last, count, state, [0, 1, 2, 3, 4, 5], 1, 6, ahead_spares=1)
    assert capped.ahead == [0, 1, 2]
    wide = plan(first, last, count, state, [0, 1, 2, 3, 4, 5], 1, 6, ahead_spares=1, min_rows=5)
    assert wide.ahead == [0, 1, 2, 3]


def test_random_fronts_match_the_definitions() -> None:
    rng = random.Random(7)
    for _ in range(500):
        pages = rng.randint(1, 8)
        n = rng.randint(1, 12)
        first = sorted(rng.randrange(pages) for _ in range(n))
        last = [min(pages - 1, p + (rng.random() < 0.3)) for p in first]
        state: list[int] = [rng.choice((MAPPED, MAPPED, MAPPED, UNMAPPED)) for _ in range(pages)]
        # a page in use is mapped
        count = [rng.choice((0, 0, 1, 2)) if s == MAPPED else 0 for s in state]
        rows = rng.sample(range(n), rng.randint(0, n))
        max_spares = rng.randint(0, 3)
        ahead = rng.randint(0, n)
        f = plan(first, last, count, state, rows, max_spares, ahead)
        slow = Slow(first, last, count, state)
        assert f.safe == slow.safe(rows, max_spares)
        assert f.pinned == slow.pinned(rows, max_spares, f.safe)
        assert f.warm == slow.warm(rows, f.safe)
        # uncapped: the pinned pages, then those of the first max(ahead, safe) rows, in
        # order of first use
        want = list(dict.fromkeys(f.pinned + slow.in_order(rows[: max(ahead, f.safe)])))
        assert f.ahead == (f.pinned if f.safe >= ahead else want)
        # capped: a prefix of that order holding the pinned pages, within the cap past them
        cap = rng.randint(0, 3)
        g = plan(first, last, count, state, rows, max_spares, ahead, ahead_spares=cap)
        assert g.ahead == f.ahead[: len(g.ahead)] and g.ahead[: len(f.pinned)] == f.pinned
        extra = [q for q in g.ahead if not count[q]]
        assert len(extra) <= max(cap, sum(1 for q in f.pinned if not count[q]))
