"""Where a slot allocation of `SwaPool` comes from, page by page.

Per page id the pool keeps its free slots (`_free_inner`, the slots whose bytes start in
the page, its tail excepted) and whether its tail slot, which straddles into the next page,
is free. Mapped pages in use with a usable free slot form the *partial* tier. An allocation
gathers from that tier first, then from spare pages, and only then asks which unmapped
pages to map (`plan_pages`); a slot is usable when every page its bytes touch is mapped.
Mixed into allocator.pool.SwaPool; see docs/allocator.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from allocator.errors import CapacityError
from allocator.store import MAPPED

if TYPE_CHECKING:
    from array import array

    from allocator.store import PageStore


class SlotGather:
    """Mixed into allocator.pool.SwaPool; the attributes below are the pool's."""

    if TYPE_CHECKING:
        name: str
        store: PageStore
        _refcount: list[int]
        _home_of: array[int]
        _tail: list[int]
        _free_inner: list[set[int]]
        _tail_free: bytearray
        _partial: dict[int, None]

        @property
        def capacity_slots(self) -> int: ...

    def _gather(self, n: int, taken: list[int]) -> None:
        """Take up to `n` free slots off mapped pages, partly occupied pages first, then
        spares. A partly occupied page leaves its tier when it has no usable slot left (the
        commit or the undo re-tiers it); spares leave theirs at the commit."""
        drop: list[int] = []
        for p in self._partial:
            if len(taken) >= n:
                break
            self._take_from_page(p, n - len(taken), taken)
            if not self._has_usable(p):
                drop.append(p)
        for p in drop:
            del self._partial[p]
        for p in self.store.spares:
            if len(taken) >= n:
                break
            self._take_from_page(p, n - len(taken), taken)

    def _take_from_page(self, p: int, k: int, taken: list[int]) -> None:
        s = self._free_inner[p]
        if k >= len(s):
            taken.extend(s)
            k -= len(s)
            s.clear()
        else:
            for _ in range(k):
                taken.append(s.pop())
            k = 0
        if k and self._tail_usable(p):
            taken.append(self._tail[p])
            self._tail_free[p] = 0

    def _tail_usable(self, p: int) -> bool:
        return bool(self._tail_free[p]) and self.store.is_mapped(p + 1)

    def _has_usable(self, p: int) -> bool:
        return bool(self._free_inner[p]) or self._tail_usable(p)

    def _return_gathered(self, taken: list[int]) -> None:
        touched = set()
        for i in taken:
            self._return_slot(i)
            touched.add(self._home_of[i])
        for p in touched:
            self._retier(p)

    def plan_pages(self, need: int, candidates: Iterable[int] | None = None) -> list[int] | None:
        """Unmapped pages whose mapping frees `need` usable slots; None if the mapper must finish
        first. Raises CapacityError (nothing changed) when the pool or the budget cannot.
        `candidates` (TP: reserved pages first) replaces the unmapped pages in their order."""
        store = self.store
        state = store.state
        plan: list[int] = []
        planned: set[int] = set()
        gained = 0
        for p in store.unmapped if candidates is None else candidates:
            if gained >= need:
                break
            plan.append(p)
            planned.add(p)
            gained += len(self._free_inner[p])
            # The tail of p needs p + 1; the tail of p - 1 needs p (and p - 1 itself).
            if self._tail_free[p] and (p + 1 in planned or store.is_mapped(p + 1)):
                gained += 1
            q = p - 1
            if q >= 0 and self._tail_free[q] and (q in planned or state[q] == MAPPED):
                gained += 1
        if gained < need:
            if store.busy:
                return None
            raise CapacityError(
                f"{self.name}: cannot allocate {need} more slots: {gained} obtainable from the "
                f"{len(store.unmapped)} unmapped pages (capacity {self.capacity_slots} slots, "
                f"{store.occupied} occupied)"
            )
        store.check_budget(
            store.sets_needed(plan), f"allocate {need} slots ({len(plan)} new page ids)"
        )
        return plan

    def _return_slot(self, i: int) -> None:
        a = self._home_of[i]
        if i == self._tail[a]:
            self._tail_free[a] = 1
        else:
            self._free_inner[a].add(i)

    # -- tiers ------------------------------------------------------------------------------------
    def pages_changed(self, pages: Iterable[int]) -> None:
        """The store mapped, unmapped or took pages busy: re-tier them and their left
        neighbours (whose tails straddle into them)."""
        for p in pages:
            self._retier(p)
            if p > 0:
                self._retier(p - 1)

    def _retier(self, p: int) -> None:
        store = self.store
        used = self._refcount[p] > 0
        store.set_use(p, used)
        if used and store.state[p] == MAPPED and self._has_usable(p):
            self._partial[p] = None
        else:
            self._partial.pop(p, None)
