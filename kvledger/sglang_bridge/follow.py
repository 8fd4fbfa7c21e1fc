"""Follow an engine's page allocator with a kvledger `SwaPool`: one engine page is one pool slot.

SGLang's paged SWA allocator hands out whole pages of `page_size` tokens (page
0 is its padding page and never handed out). The bridge lays the SWA buffer
out so that one engine page is one row of the VMM buffer and one kvledger slot:
taking an engine page occupies that slot (mapping the VMM pages its row
touches), giving it back frees the slot (and the pool unmaps what empties).
The pool's reserved null slot is slot 0, SGLang's padding page, which stays
mapped for the dummy writes of padded tokens.

The ledger counts the SWA family in tokens (as SGLang's allocator reports its
capacity), so `TokenObserver` scales the pool's slot figures by `page_size`.

A page the follower is told to take twice, or to give back while not held,
means the engine and the follower disagree. It is not applied, it is counted in
`divergences` and logged: raising inside the engine's allocator would take the
scheduler down for a bookkeeping error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from accounting.events import PoolEvent, PoolObserver
from allocator.pool import SwaPool

log = logging.getLogger(__name__)


class TokenObserver:
    """Forwards pool events to `target`, slot counts multiplied by `tokens_per_slot`."""

    def __init__(self, target: PoolObserver, tokens_per_slot: int) -> None:
        if (
            isinstance(tokens_per_slot, bool)
            or not isinstance(tokens_per_slot, int)
            or tokens_per_slot <= 0
        ):
            raise ValueError(f"tokens_per_slot={tokens_per_slot!r}, expected a positive int")
        self.target = target
        self.tokens_per_slot = tokens_per_slot

    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        if event in (PoolEvent.SLOTS_OCCUPIED, PoolEvent.SLOTS_FREED):
            count *= self.tokens_per_slot
        self.target.on_pool_event(event, count, seconds)

    def on_slots(self, occupied: int, peak: int) -> None:
        self.target.on_slots(occupied * self.tokens_per_slot, peak * self.tokens_per_slot)

    def attach(self, flush: Callable[[], None]) -> None:
        self.target.attach(flush)

    def detach(self, flush: Callable[[], None]) -> None:
        self.target.detach(flush)

    def at_safe_point(self) -> None:
        self.target.at_safe_point()


class PageFollower:
    """Mirrors which engine pages are held into `pool` (slots = engine pages)."""

    def __init__(self, pool: SwaPool, *, first_page: int = 1) -> None:
        if pool.null_slot is None:
            raise ValueError(
                f"pool {pool.name!r} has no null slot, expected one for the engine's padding page"
            )
        if not 0 < first_page < pool.layout.capacity_slots:
            raise ValueError(
                f"first_page={first_page!r}, expected 0 < first_page < "
                f"{pool.layout.capacity_slots} (the pool's slots)"
            )
        self.pool = pool
        self.first_page = first_page
        self.end_page = pool.layout.capacity_slots
        self._held = bytearray(self.end_page)
        self._count = 0
        self._lock = threading.Lock()
        self.divergences = 0

    @property
    def held_pages(self) -> int:
        return self._count

    def held(self) -> list[int]:
        with self._lock:
            return [p for p in range(self.first_page, self.end_page) if self._held[p]]

    def is_held(self, page: int) -> bool:
        return 0 <= page < self.end_page and bool(self._held[page])

    def take(self, pages: Iterable[int]) -> list[int]:
        """The engine handed out `pages`: occupy their slots. Returns the pages applied."""
        with self._lock:
            fresh = self._sort_out(pages, want_held=False, op="take")
            if fresh:
                self.pool.occupy(fresh)  # all or nothing; raises CapacityError on a budget
                for p in fresh:
                    self._held[p] = 1
                self._count += len(fresh)
            return fresh

    def give_back(self, pages: Iterable[int]) -> list[int]:
        """The engine returned `pages` to its free list: free their slots."""
        with self._lock:
            held = self._sort_out(pages, want_held=True, op="give_back")
            if held:
                self.pool.free(held)
                for p in held:
                    self._held[p] = 0
                self._count -= len(held)
            return held

    def give_back_all(self) -> list[int]:
        with self._lock:
            held = [p for p in range(self.first_page, self.end_page) if self._held[p]]
            if held:
                self.pool.free(held)
                for p in held:
                    self._held[p] = 0
                self._count = 0
            return held

    def _sort_out(self, pages: Iterable[int], *, want_held: bool, op: str) -> list[int]:
        out: list[int] = []
        seen: set[int] = set()
        bad: list[int] = []
        for p in pages:
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(f"{op}: page {p!r}, expected an int")
            if not self.first_page <= p < self.end_page or p in seen:
                bad.append(p)
                continue
            seen.add(p)
            if bool(self._held[p]) != want_held:
                bad.append(p)
                continue
            out.append(p)
        if bad:
            self.divergences += len(bad)
            state = "not held (foreign or double give-back)" if want_held else "already held"
            log.warning(
                "kvledger sglang bridge: %s of engine pages %s skipped: %s or outside "
                "[%d, %d); the engine and the follower disagree",
                op,
                bad[:16],
                state,
                self.first_page,
                self.end_page,
            )
        return out
