"""Where a slot allocation of `SwaPool` comes from, page by page: the slot tiers.

Per page id `SlotGather` keeps its free slots (those whose bytes start in the page, its
*tail* excepted), whether its tail slot, which straddles into the next page, is free, and
how many occupied slots touch it (`refcount`: a page is in use while it is not zero).
Mapped pages in use with a usable free slot form the *partial* tier. An allocation gathers
from that tier first, then from the store's spare pages, and only then asks which unmapped
pages to map (`plan_pages`); a slot is usable when every page its bytes touch is mapped.

Given the pool's page store, it is the store's user (allocator.store): it tells the store
which pages are in use (`set_use`) and re-tiers pages the store maps, unmaps or takes busy
(`pages_changed`). Every method: the store's lock held. See docs/allocator.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from allocator.errors import CapacityError
from allocator.slots.layout import SlotLayout
from allocator.states import PageState

if TYPE_CHECKING:
    from allocator.store import PageStore

_MAPPED = PageState.MAPPED  # bound once: `retier` runs for every page an allocation touches


class SlotGather:
    def __init__(
        self, store: PageStore, layout: SlotLayout, *, capacity_slots: int, name: str
    ) -> None:
        self.store = store
        self.name = name
        self.capacity_slots = capacity_slots  # slots that can be handed out (for messages)
        self.refcount = [0] * layout.num_pages  # occupied slots touching each page
        # home_of[i]: the page holding slot i's first byte; a slot that straddles into
        # home + 1 is that page's tail (tail[p], or -1). free_inner[p]: the free slots of p
        # other than its tail; tail_free[p]: 1 while p's tail is free.
        self.home_of, self.tail, self.free_inner = layout.page_index()
        self.tail_free = bytearray(1 if t >= 0 else 0 for t in self.tail)
        self.partial: dict[int, None] = {}  # mapped, in use, maybe usable free slots

    # -- gathering ---------------------------------------------------------------------------
    def gather(self, n: int, taken: list[int]) -> None:
        """Take up to `n` free slots off mapped pages into `taken`, partly occupied pages
        first, then spares. A partly occupied page leaves its tier when it has no usable
        slot left (`hold` or `return_gathered` re-tiers it); spares leave theirs at `hold`."""
        drop: list[int] = []
        for p in self.partial:
            if len(taken) >= n:
                break
            self._take_from_page(p, n - len(taken), taken)
            if not self._has_usable(p):
                drop.append(p)
        for p in drop:
            del self.partial[p]
        for p in self.store.spares:
            if len(taken) >= n:
                break
            self._take_from_page(p, n - len(taken), taken)

    def _take_from_page(self, p: int, k: int, taken: list[int]) -> None:
        s = self.free_inner[p]
        if k >= len(s):
            taken.extend(s)
            k -= len(s)
            s.clear()
        else:
            for _ in range(k):
                taken.append(s.pop())
            k = 0
        if k and self._tail_usable(p):
            taken.append(self.tail[p])
            self.tail_free[p] = 0

    def _tail_usable(self, p: int) -> bool:
        return bool(self.tail_free[p]) and self.store.is_mapped(p + 1)

    def _has_usable(self, p: int) -> bool:
        return bool(self.free_inner[p]) or self._tail_usable(p)

    def return_gathered(self, taken: list[int]) -> None:
        """Put slots `gather` took back, as free (an allocation that cannot complete)."""
        touched = set()
        for i in taken:
            self._return_slot(i)
            touched.add(self.home_of[i])
        for p in touched:
            self.retier(p)

    def _return_slot(self, i: int) -> None:
        a = self.home_of[i]
        if i == self.tail[a]:
            self.tail_free[a] = 1
        else:
            self.free_inner[a].add(i)

    def plan_pages(self, need: int, candidates: Iterable[int] | None = None) -> list[int] | None:
        """Unmapped pages whose mapping frees `need` usable slots; None if the background
        mapper must finish first. Raises CapacityError (nothing changed) when the pool or the
        budget cannot. `candidates` (TP: reserved pages first) replaces the unmapped pages in
        their order."""
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
            gained += len(self.free_inner[p])
            # The tail of p needs p + 1; the tail of p - 1 needs p (and p - 1 itself).
            if self.tail_free[p] and (p + 1 in planned or store.is_mapped(p + 1)):
                gained += 1
            q = p - 1
            if q >= 0 and self.tail_free[q] and (q in planned or state[q] == _MAPPED):
                gained += 1
        if gained < need:
            if store.busy:
                return None
            raise CapacityError(
                f"{self.name}: cannot allocate {need} more slots: {gained} obtainable from the "
                f"{len(store.unmapped)} unmapped pages (capacity {self.capacity_slots} slots, "
                f"{store.reporter.occupied} occupied)"
            )
        store.check_budget(
            store.sets_needed(plan), f"allocate {need} slots ({len(plan)} new page ids)"
        )
        return plan

    # -- occupancy -----------------------------------------------------------------------------
    def hold(self, slots: list[int]) -> None:
        """Slots became occupied (gathered, or claimed): their pages count them."""
        touched = set()
        refcount, home_of, tail = self.refcount, self.home_of, self.tail
        for i in slots:
            a = home_of[i]
            refcount[a] += 1
            touched.add(a)
            if tail[a] == i:
                refcount[a + 1] += 1
                touched.add(a + 1)
        for p in touched:
            self.retier(p)

    def claim(self, slots: list[int]) -> None:
        """Slots chosen elsewhere (`SwaPool.occupy`) leave the free slots; `hold` them next."""
        touched = set()
        for i in slots:
            a = self.home_of[i]
            if i == self.tail[a]:
                self.tail_free[a] = 0
            else:
                self.free_inner[a].discard(i)
            touched.add(a)
        for p in touched:
            self.retier(p)

    def release(self, slots: list[int]) -> None:
        """Occupied slots became free: their pages stop counting them."""
        touched = set()
        refcount, home_of, tail = self.refcount, self.home_of, self.tail
        free_inner, tail_free = self.free_inner, self.tail_free
        for i in slots:
            a = home_of[i]
            refcount[a] -= 1
            touched.add(a)
            if tail[a] == i:
                refcount[a + 1] -= 1
                touched.add(a + 1)
                tail_free[a] = 1
            else:
                free_inner[a].add(i)
        for p in touched:
            self.retier(p)

    # -- tiers ---------------------------------------------------------------------------------
    def pages_changed(self, pages: Iterable[int]) -> None:
        """The store mapped, unmapped or took pages busy: re-tier them and their left
        neighbours (whose tails straddle into them)."""
        for p in pages:
            self.retier(p)
            if p > 0:
                self.retier(p - 1)

    def retier(self, p: int) -> None:
        """Tell the store whether page `p` is in use; keep it in the partial tier while it
        is in use, mapped and has a usable free slot."""
        store = self.store
        used = self.refcount[p] > 0
        store.set_use(p, used)
        if used and store.state[p] == _MAPPED and self._has_usable(p):
            self.partial[p] = None
        else:
            self.partial.pop(p, None)
