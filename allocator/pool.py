"""The SWA KV pool on a VMM backend: slots handed out, pages mapped and unmapped to match.

State of a page id: UNMAPPED, MAPPED, or BUSY (the background mapper is mapping
or unmapping it outside the lock). A MAPPED page with no occupied slot touching
it is a *spare*; spares beyond `max_spare_pages` are unmapped, and their handle
sets are kept (up to `handle_pool_pages`) for the next map. Every handle set
alive, mapped or kept, counts against `physical_budget`.

Allocation takes slots from partly occupied pages first, then from spare pages,
and only then maps new pages. Nothing changes unless the whole request can be
met. Every change of handles and mappings is reported to the observer after it
happened; the occupied-slot figure is reported as the pool's own count (before
the next page event, every `REPORT_EVERY` calls, and when the observer flushes),
so an allocation costs the observer nothing (accounting.events).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Any

from accounting.events import PoolEvent, PoolObserver
from allocator.backend import Backend
from allocator.errors import CapacityError, ClosedError, SlotError
from allocator.layout import SlotLayout
from allocator.pages import LayerSet

UNMAPPED, MAPPED, BUSY = 0, 1, 2

# alloc/free/occupy calls between two slot reports and safe points (accounting.events).
REPORT_EVERY = 64


class _NullObserver:
    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        pass

    def on_slots(self, occupied: int, peak: int) -> None:
        pass

    def attach(self, flush: Callable[[], None]) -> None:
        pass

    def detach(self, flush: Callable[[], None]) -> None:
        pass

    def at_safe_point(self) -> None:
        pass


class SwaPool:
    def __init__(
        self,
        backend: Backend,
        *,
        layers: int,
        layout: SlotLayout,
        physical_budget: int | None = None,
        min_spare_pages: int = 0,
        max_spare_pages: int = 1,
        handle_pool_pages: int | None = None,
        null_slot: bool = True,
        observer: PoolObserver | None = None,
        name: str = "swa",
    ) -> None:
        if layout.page_bytes % backend.granularity:
            raise ValueError(
                f"page_bytes={layout.page_bytes}, expected a multiple of the backend granularity "
                f"{backend.granularity}"
            )
        if not 0 <= min_spare_pages <= max_spare_pages:
            raise ValueError(
                f"min_spare_pages={min_spare_pages}, max_spare_pages={max_spare_pages}: "
                "expected 0 <= min_spare_pages <= max_spare_pages"
            )
        self.name = name
        self.layout = layout
        self.layers = layers
        self.page_bytes = layout.page_bytes
        self.set_bytes = layers * layout.page_bytes  # physical bytes of one page id
        if physical_budget is not None and physical_budget < self.set_bytes:
            raise ValueError(
                f"physical_budget={physical_budget}, expected at least one page id "
                f"({layers} layers x {layout.page_bytes} bytes = {self.set_bytes})"
            )
        self.physical_budget = physical_budget
        self.min_spare_pages = min_spare_pages
        self.max_spare_pages = max_spare_pages
        self.handle_pool_pages = max_spare_pages if handle_pool_pages is None else handle_pool_pages
        self._observer: PoolObserver = observer or _NullObserver()
        # Reentrant: a ledger snapshot taken by a thread that holds it (to read the pool and
        # the ledger at one instant) flushes the slot figure through `report_slots`.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._closed = False

        n_pages = layout.num_pages
        self._state = bytearray(n_pages)
        self._handles: list[list[int] | None] = [None] * n_pages
        self._refcount = [0] * n_pages
        self._free_inner: list[set[int]] = []
        self._tail = [-1] * n_pages
        self._tail_free = bytearray(n_pages)
        self._occupied = bytearray(layout.capacity_slots)
        self._occupied_count = 0
        self._slot_peak = 0  # the most occupied since the last report to the observer
        self._reported_slots = 0  # the occupied count that report carried
        self._calls = 0  # alloc/free/occupy calls since the last safe point
        self._partial: dict[int, None] = {}  # mapped, refcount > 0, maybe usable free slots
        self._empty: dict[int, None] = {}  # mapped, refcount == 0: spares
        self._unmapped: list[int] = list(range(n_pages))  # min-heap-free: kept sorted
        self._spare_sets: list[list[int]] = []
        self._live_sets = 0  # mapped + kept + being created
        self._busy = 0
        self._build_page_index()

        # First, so an observer that refuses (an account another pool follows) costs nothing.
        self._observer.attach(self.report_slots)
        try:
            self._pages = LayerSet(
                backend,
                layers=layers,
                reserved_bytes=layout.reserved_bytes,
                page_bytes=layout.page_bytes,
            )
        except BaseException:
            self._observer.detach(self.report_slots)
            raise
        try:
            self.tensors = [self._pages.byte_tensor(i, layout.buffer_bytes) for i in range(layers)]
        except BaseException:
            self._pages.free_reservations()
            self._observer.detach(self.report_slots)
            raise
        self._mapper: Any = None  # set by allocator.mapper.BackgroundMapper
        self._tp: Any = None  # set by allocator.tp.TpCoordinator (see the TP section below)
        self._tp_reserve: dict[int, _Ahead] = {}  # TP pages announced ahead (see that section)
        self.null_slot = 0 if null_slot else None
        if null_slot:
            try:
                with self._lock:
                    self._occupy_locked_entry([0], count=False)
            except BaseException:
                self.close()
                raise

    # -- geometry -----------------------------------------------------------------------
    def _build_page_index(self) -> None:
        lay = self.layout
        cap = lay.capacity_slots
        starts = [self._first_slot_at(p * lay.page_bytes) for p in range(lay.num_pages)] + [cap]
        # home[i]: the page holding slot i's first byte; a slot that straddles into home + 1 is
        # that page's tail. Kept as a C array (4 bytes a slot) for the per-slot hot loops.
        self._home_of = array("i")
        for p in range(lay.num_pages):
            a, b = starts[p], starts[p + 1]
            self._home_of.extend(array("i", [p]) * (b - a))
            inner = set(range(a, b))
            if b > a and lay.slot_pages(b - 1)[1] != p:
                inner.discard(b - 1)
                self._tail[p] = b - 1
                self._tail_free[p] = 1
            self._free_inner.append(inner)

    def _first_slot_at(self, offset: int) -> int:
        lo, hi = 0, self.layout.capacity_slots
        while lo < hi:
            mid = (lo + hi) // 2
            if self.layout.slot_offset(mid) < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @property
    def capacity_slots(self) -> int:
        """Slots that can be handed out (the null slot excluded)."""
        return self.layout.capacity_slots - (self.null_slot is not None)

    # -- public API ------------------------------------------------------------------------
    def alloc(self, n: int) -> Any:
        """Hand out `n` free slots as an int64 tensor; maps pages if it must. All or nothing."""
        import torch

        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"alloc: n={n!r}, expected a non-negative int")
        with self._lock:
            self._check_open("alloc")
            if self._tp is None:
                taken = self._alloc_locked(n)
            else:
                taken = self._tp_run("alloc", n, lambda: self._alloc_locked(n))
            self._calls += 1
        if self._calls >= REPORT_EVERY:
            self._safe_point()
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, ids: Any) -> None:
        """Return slots. Double frees, the null slot and ids out of range raise; nothing changes."""
        slots = _as_list(ids)
        with self._lock:
            self._check_open("free")
            self._validate(slots, "free", want_occupied=True)
            if self._tp is None:
                self._free_locked(slots)
                self._after_free_locked()
            else:
                self._tp_run("free", len(slots), lambda: self._tp_free_locked(slots))
            self._calls += 1
        if self._calls >= REPORT_EVERY:
            self._safe_point()

    def occupy(self, ids: Any) -> None:
        """Follow ids chosen elsewhere (an engine's allocator, TP rank 0): mark them occupied,
        mapping the pages they need. All or nothing."""
        slots = _as_list(ids)
        with self._lock:
            self._check_open("occupy")
            if self._tp is not None:
                raise RuntimeError(
                    f"{self.name}.occupy: not supported while the pool follows a TP group "
                    "(allocator.tp); use alloc/free on every rank"
                )
            self._occupy_locked_entry(slots, count=True)
            self._calls += 1
        if self._calls >= REPORT_EVERY:
            self._safe_point()

    def report_slots(self) -> None:
        """Report the occupied-slot figure to the observer now (its `flush`); a no-op once
        closed."""
        with self._lock:
            if not self._closed:
                self._report_slots_locked()

    def _report_slots_locked(self) -> None:
        count = self._occupied_count
        if count != self._reported_slots or self._slot_peak != count:
            self._observer.on_slots(count, max(self._slot_peak, count))
            self._reported_slots = self._slot_peak = count

    def _safe_point(self) -> None:
        self._calls = 0
        self.report_slots()
        self._observer.at_safe_point()

    def _emit(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        """Report a page or handle event (under the lock), the slots it follows first."""
        self._report_slots_locked()
        self._observer.on_pool_event(event, count, seconds)

    def buffer(self, layer: int, dtype: Any = None, shape: tuple[int, ...] | None = None) -> Any:
        """Layer `layer`'s buffer viewed as `dtype` in `shape` (default: rows x row bytes)."""
        self._check_open("buffer")
        t = self.tensors[layer]
        if dtype is not None:
            t = t.view(dtype)
        return t.view(shape if shape is not None else (self.layout.rows, -1))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "occupied_slots": self._occupied_count,
                "mapped_pages": sum(1 for s in self._state if s == MAPPED),
                "spare_pages": len(self._empty),
                "kept_handle_sets": len(self._spare_sets),
                "live_handle_sets": self._live_sets,
                "physical_bytes": self._live_sets * self.set_bytes,
                "busy_pages": self._busy,
            }

    def is_page_mapped(self, page: int) -> bool:
        return self._state[page] == MAPPED

    def occupied_ids(self) -> list[int]:
        with self._lock:
            return [i for i, o in enumerate(self._occupied) if o and i != self.null_slot]

    # -- allocation ------------------------------------------------------------------------
    def _alloc_locked(self, n: int) -> list[int]:
        while True:
            taken: list[int] = []
            self._gather(n, taken)
            if len(taken) == n:
                break
            need = n - len(taken)
            try:
                plan = self._plan_pages(need) if self._tp is None else self._tp.plan_map(need)
            except BaseException:  # CapacityError: give back what was gathered
                self._return_gathered(taken)
                raise
            if plan is None:  # the mapper holds pages we would need: wait for it, then retry
                self._return_gathered(taken)
                self._cond.wait(timeout=1.0)
                self._check_open("alloc")
                continue
            try:
                self._map_pages_locked(plan)
            except BaseException:
                self._return_gathered(taken)
                raise
            self._gather(n, taken)
            if len(taken) != n:  # pragma: no cover - the plan guarantees enough slots
                self._return_gathered(taken)
                raise AssertionError(
                    f"alloc: planned pages {plan} yielded {len(taken)} of {n} slots"
                )
            break
        self._commit(taken)
        return taken

    def _gather(self, n: int, taken: list[int]) -> None:
        """Take up to `n` free slots off mapped pages, partly occupied pages first.

        A page leaves its tier only when slots were taken from it (the commit or the undo
        re-tiers it). A spare page with no usable slot (only a straddling slot whose next
        page is unmapped) stays a spare: dropping it would hide it from trimming."""
        for tier in (self._partial, self._empty):
            drop: list[int] = []
            for p in tier:
                if len(taken) >= n:
                    break
                before = len(taken)
                self._take_from_page(p, n - len(taken), taken)
                if not self._has_usable(p) and (tier is self._partial or len(taken) > before):
                    drop.append(p)
            for p in drop:
                del tier[p]

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

    def _is_mapped(self, p: int) -> bool:
        return p < len(self._state) and self._state[p] == MAPPED

    def _tail_usable(self, p: int) -> bool:
        return bool(self._tail_free[p]) and self._is_mapped(p + 1)

    def _has_usable(self, p: int) -> bool:
        return bool(self._free_inner[p]) or self._tail_usable(p)

    def _return_gathered(self, taken: list[int]) -> None:
        touched = set()
        for i in taken:
            self._return_slot(i)
            touched.add(self._home(i))
        for p in touched:
            self._retier(p)

    def _plan_pages(self, need: int, candidates: Iterable[int] | None = None) -> list[int] | None:
        """Unmapped pages whose mapping frees `need` usable slots; None if the mapper must finish
        first. Raises CapacityError (nothing changed) when the pool or the budget cannot.
        `candidates` (TP: reserved pages first) replaces the unmapped pages in their order."""
        plan: list[int] = []
        planned: set[int] = set()
        gained = 0
        for p in self._unmapped if candidates is None else candidates:
            if gained >= need:
                break
            plan.append(p)
            planned.add(p)
            gained += len(self._free_inner[p])
            # The tail of p needs p + 1; the tail of p - 1 needs p (and p - 1 itself).
            if self._tail_free[p] and (p + 1 in planned or self._is_mapped(p + 1)):
                gained += 1
            q = p - 1
            if q >= 0 and self._tail_free[q] and (q in planned or self._state[q] == MAPPED):
                gained += 1
        if gained < need:
            if self._busy:
                return None
            raise CapacityError(
                f"{self.name}: cannot allocate {need} more slots: {gained} obtainable from the "
                f"{len(self._unmapped)} unmapped pages (capacity {self.capacity_slots} slots, "
                f"{self._occupied_count} occupied)"
            )
        unheld = sum(1 for p in plan if p not in self._tp_reserve)  # reserved pages hold a set
        new_sets = max(0, unheld - len(self._spare_sets))
        self._check_budget(new_sets, f"allocate {need} slots ({len(plan)} new page ids)")
        return plan

    def _check_budget(self, new_sets: int, what: str) -> None:
        if self.physical_budget is None or new_sets == 0:
            return
        after = (self._live_sets + new_sets) * self.set_bytes
        if after > self.physical_budget:
            raise CapacityError(
                f"{self.name}: cannot {what}: physical bytes would be {after}, over the budget "
                f"physical_budget={self.physical_budget} ({self._live_sets} page ids held, "
                f"{self.set_bytes} bytes each)"
            )

    def _budget_allows_one(self) -> bool:
        return (
            self.physical_budget is None
            or (self._live_sets + 1) * self.set_bytes <= self.physical_budget
        )

    def _map_pages_locked(self, plan: list[int]) -> None:
        """Map every page of `plan` (sync, under the lock). All or nothing."""
        if not plan:  # TP: rank 0 published pages mapped ahead and needs no new one
            return
        done: list[tuple[int, list[int], bool]] = []
        created = 0
        t0 = time.perf_counter()
        try:
            for p in plan:
                fresh = not self._spare_sets
                handles = self._pages.create_set() if fresh else self._spare_sets.pop()
                if fresh:
                    created += 1
                    self._live_sets += 1
                try:
                    self._pages.map_page(p, handles)
                except BaseException:
                    self._put_back_set(handles, fresh)
                    if fresh:
                        created -= 1
                    raise
                done.append((p, handles, fresh))
        except BaseException:
            for p, handles, fresh in reversed(done):
                with contextlib.suppress(Exception):
                    self._pages.unmap_page(p)
                self._put_back_set(handles, fresh)
            raise
        seconds = time.perf_counter() - t0
        if created:
            self._emit(PoolEvent.HANDLES_CREATED, created)
        for p, handles, _ in done:
            self._set_mapped(p, handles)
        self._emit(PoolEvent.PAGES_MAPPED, len(done), seconds)

    def _put_back_set(self, handles: list[int], fresh: bool) -> None:
        """Undo the taking of a handle set for a map that failed."""
        if fresh:
            self._live_sets -= 1
            with contextlib.suppress(Exception):
                self._pages.release_set(handles)
        else:
            self._spare_sets.append(handles)

    def _set_mapped(self, p: int, handles: list[int]) -> None:
        self._state[p] = MAPPED
        self._handles[p] = handles
        i = bisect.bisect_left(self._unmapped, p)
        if i < len(self._unmapped) and self._unmapped[i] == p:
            del self._unmapped[i]
        self._retier(p)
        if p > 0:
            self._retier(p - 1)

    def _commit(self, taken: list[int]) -> None:
        touched = set()
        occupied, refcount, home_of, tail = (
            self._occupied,
            self._refcount,
            self._home_of,
            self._tail,
        )
        for i in taken:
            occupied[i] = 1
            a = home_of[i]
            refcount[a] += 1
            touched.add(a)
            if tail[a] == i:
                refcount[a + 1] += 1
                touched.add(a + 1)
        for p in touched:
            self._retier(p)
        count = self._occupied_count = self._occupied_count + len(taken)
        if count > self._slot_peak:
            self._slot_peak = count
        if len(self._empty) < self.min_spare_pages:
            self._cond.notify_all()

    # -- follow mode ------------------------------------------------------------------------
    def _occupy_locked_entry(self, slots: list[int], *, count: bool) -> None:
        while True:
            # (re)checked after every wait: another thread may have taken an id meanwhile
            self._validate(slots, "occupy", want_occupied=False)
            missing = sorted(
                {
                    p
                    for i in slots
                    for p in set(self.layout.slot_pages(i))
                    if self._state[p] != MAPPED
                }
            )
            if any(self._state[p] == BUSY for p in missing):
                self._cond.wait(timeout=1.0)
                self._check_open("occupy")
                continue
            break
        if missing:
            new_sets = max(0, len(missing) - len(self._spare_sets))
            self._check_budget(new_sets, f"occupy {len(slots)} slots ({len(missing)} new page ids)")
            self._map_pages_locked(missing)
        touched = set()
        for i in slots:
            a = self._home(i)
            if i == self._tail[a]:
                self._tail_free[a] = 0
            else:
                self._free_inner[a].discard(i)
            touched.add(a)
        for p in touched:
            self._retier(p)
        if count:
            self._commit(slots)
        else:  # the null slot: held, never counted as a live request's
            self._commit_uncounted(slots)

    def _commit_uncounted(self, slots: list[int]) -> None:
        for i in slots:
            self._occupied[i] = 1
            for p in set(self.layout.slot_pages(i)):
                self._refcount[p] += 1
                self._retier(p)

    # -- free ---------------------------------------------------------------------------------
    def _validate(self, slots: list[int], op: str, *, want_occupied: bool) -> None:
        cap = self.layout.capacity_slots
        occupied = self._occupied
        want = int(want_occupied)
        # One comprehension over the ids (the common case: all fine), then the details.
        bad = [i for i in slots if not 0 <= i < cap or occupied[i] != want]
        null = self.null_slot
        if (
            not bad
            and len(set(slots)) == len(slots)
            and (null is None or not occupied[null] or null not in slots)
        ):
            return
        seen: set[int] = set()
        for i in slots:
            if not 0 <= i < cap:
                raise SlotError(
                    f"{self.name}.{op}: slot id {i} is out of range, expected 0 <= id < {cap}"
                )
            if i == null and occupied[i]:
                raise SlotError(f"{self.name}.{op}: slot id {i} is the reserved null slot")
            if i in seen:
                raise SlotError(f"{self.name}.{op}: slot id {i} appears twice in one call")
            seen.add(i)
            if occupied[i] != want:
                state = "free (double free or foreign id)" if want_occupied else "already occupied"
                raise SlotError(f"{self.name}.{op}: slot id {i} is {state}")

    def _free_locked(self, slots: list[int]) -> None:
        touched = set()
        occupied, refcount, home_of, tail = (
            self._occupied,
            self._refcount,
            self._home_of,
            self._tail,
        )
        free_inner, tail_free = self._free_inner, self._tail_free
        for i in slots:
            occupied[i] = 0
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
            self._retier(p)
        self._occupied_count -= len(slots)

    def _return_slot(self, i: int) -> None:
        a = self._home(i)
        if i == self._tail[a]:
            self._tail_free[a] = 1
        else:
            self._free_inner[a].add(i)

    def _after_free_locked(self) -> None:
        if len(self._empty) > self.max_spare_pages:
            if self._tp is not None:
                self._tp_trim_locked()
            elif self._mapper_running():
                self._cond.notify_all()
            else:
                self._trim_locked()

    def _mapper_running(self) -> bool:
        return self._mapper is not None

    def _trim_locked(self) -> None:
        """Unmap spare pages beyond max_spare_pages, the most recently emptied first (sync)."""
        while len(self._empty) > self.max_spare_pages:
            self._unmap_spare_locked(next(reversed(self._empty)))

    def _unmap_spare_locked(self, p: int) -> None:
        """Unmap spare page `p` now, under the lock; keep or release its handle set."""
        self._begin_unmap(p)
        t0 = time.perf_counter()
        try:
            self._pages.unmap_page(p, self._handles[p])
        except BaseException:  # unmap_page put the page back whole
            self._state[p] = MAPPED
            self._busy -= 1
            self._retier(p)
            if p > 0:
                self._retier(p - 1)
            raise
        handles = self._finish_unmap(p, time.perf_counter() - t0)
        if handles is not None:
            try:
                self._pages.release_set(handles)
            finally:
                self._released_set()

    # -- background steps (allocator.mapper runs these off the allocation path) -------------
    def background_step(self) -> bool:
        """Map one spare page ahead or unmap one behind, driver calls outside the lock.

        Returns False when the watermarks are met (nothing to do)."""
        with self._lock:
            if self._closed:
                return False
            if len(self._empty) < self.min_spare_pages and self._unmapped:
                fresh = not self._spare_sets
                if fresh and not self._budget_allows_one():
                    return False
                p = self._unmapped.pop(0)
                self._state[p] = BUSY
                self._busy += 1
                handles = None if fresh else self._spare_sets.pop()
                if fresh:
                    self._live_sets += 1
                action = "map"
            elif len(self._empty) > self.max_spare_pages:
                p = next(reversed(self._empty))
                self._begin_unmap(p)
                action = "unmap"
            else:
                return False
        if action == "map":
            self._background_map(p, handles)
        else:
            self._background_unmap(p)
        return True

    def _background_map(self, p: int, handles: list[int] | None) -> None:
        fresh = handles is None
        t0 = time.perf_counter()
        try:
            if handles is None:
                handles = self._pages.create_set()
            self._pages.map_page(p, handles)
        except BaseException:
            with self._lock:
                if handles is not None:
                    self._put_back_set(handles, fresh)
                elif fresh:
                    self._live_sets -= 1
                self._state[p] = UNMAPPED
                self._busy -= 1
                bisect.insort(self._unmapped, p)
                self._cond.notify_all()
            raise
        seconds = time.perf_counter() - t0
        with self._lock:
            if fresh:
                self._emit(PoolEvent.HANDLES_CREATED, 1)
            self._busy -= 1
            self._set_mapped(p, handles)
            self._emit(PoolEvent.PAGES_MAPPED, 1, seconds)
            self._cond.notify_all()

    def _background_unmap(self, p: int) -> None:
        t0 = time.perf_counter()
        try:
            self._pages.unmap_page(p, self._handles[p])
        except BaseException:  # unmap_page put the page back whole
            with self._lock:
                self._state[p] = MAPPED
                self._busy -= 1
                self._retier(p)
                if p > 0:
                    self._retier(p - 1)
                self._cond.notify_all()
            raise
        seconds = time.perf_counter() - t0
        with self._lock:
            handles = self._finish_unmap(p, seconds)
        if handles is not None:
            try:
                self._pages.release_set(handles)
            finally:
                with self._lock:
                    self._released_set()

    def _begin_unmap(self, p: int) -> None:
        self._state[p] = BUSY
        self._busy += 1
        self._empty.pop(p, None)
        self._partial.pop(p, None)
        if p > 0:
            self._retier(p - 1)

    def _finish_unmap(self, p: int, seconds: float) -> list[int] | None:
        """Mark `p` unmapped; keep its handle set, or return it for the caller to release
        (then call `_released_set`)."""
        handles = self._handles[p]
        assert handles is not None
        self._handles[p] = None
        self._state[p] = UNMAPPED
        bisect.insort(self._unmapped, p)
        self._emit(PoolEvent.PAGES_UNMAPPED, 1, seconds)
        self._cond.notify_all()
        if len(self._spare_sets) < self.handle_pool_pages:
            self._spare_sets.append(handles)
            self._busy -= 1
            return None
        return handles  # still busy until released

    def _released_set(self) -> None:
        self._busy -= 1
        self._live_sets -= 1
        self._emit(PoolEvent.HANDLES_RELEASED, 1)
        self._cond.notify_all()

    # -- tensor parallelism (driven by allocator.tp; its docstring has the protocol) -----------
    # Under TP the pool runs no background mapper: every change of the allocatable pages
    # happens inside an alloc or a free, where it is a function of the operation sequence
    # (pages mapped ahead become allocatable only there, see below). `self._tp` is the
    # rank's coordinator: on rank 0 it lets this pool's policy plan and sends the plan to the
    # peers; on a peer it returns rank 0's plan instead of planning (the peer's policy is off).
    def _tp_run(self, op: str, n: int, body: Any) -> list[int]:
        tp = self._tp
        tp.op_started(op, n)
        ids: list[int] = []
        try:
            out = body()
            ids = out if out is not None else []
            return ids
        finally:
            tp.op_done(ids)

    def _tp_free_locked(self, slots: list[int]) -> list[int]:
        self._free_locked(slots)
        self._after_free_locked()
        return slots

    def _tp_trim_locked(self) -> None:
        excess = len(self._empty) - self.max_spare_pages
        for p in self._tp.plan_unmap(excess):
            self._unmap_spare_locked(p)

    def tp_trim_plan(self, excess: int) -> list[int]:
        """The spare pages `_trim_locked` would unmap to drop `excess` of them, in order."""
        return list(reversed(self._empty))[:excess]

    def tp_state(self) -> dict[str, int]:
        """The figures every rank compares at an exchange (call under the pool's lock)."""
        return {
            "occupied_slots": self._occupied_count,
            "mapped_pages": self._state.count(MAPPED),
            "spare_pages": len(self._empty),
            "live_handle_sets": self._live_sets,
            "reserved_pages": len(self._tp_reserve),
        }

    def tp_config(self) -> tuple[int, ...]:
        """What must be equal on every rank for the ranks to make the same choices."""
        return (
            self.layers,
            self.page_bytes,
            self.layout.capacity_slots,
            self.layout.slot_bytes,
            self.layout.slots_per_row,
            self.layout.row_bytes,
            self.max_spare_pages,
            self.handle_pool_pages,
            -1 if self.physical_budget is None else self.physical_budget,
            -1 if self.null_slot is None else self.null_slot,
        )

    def tp_page_state(self, page: int) -> str:
        """'unmapped', 'reserved' (announced ahead), 'spare' (mapped, no occupied slot), 'used'
        or 'busy'."""
        if page in self._tp_reserve:
            return "reserved"
        if self._state[page] == BUSY:
            return "busy"
        if self._state[page] == UNMAPPED:
            return "unmapped"
        return "spare" if page in self._empty else "used"

    # Pages mapped ahead (TpCoordinator(ahead_pages=k)). Rank 0 announces reserved pages at an
    # exchange; every rank marks them at the same point of the operation sequence (out of
    # `_unmapped`, state BUSY, a handle set counted: so every decision stays a function of
    # the sequence), its coordinator's thread maps them off the allocation path, and a later
    # exchange publishes them (MAPPED, in the tiers), mapping here any the thread has not.
    def tp_reserve_locked(self, pages: list[int]) -> None:
        for p in pages:
            i = bisect.bisect_left(self._unmapped, p)
            if i == len(self._unmapped) or self._unmapped[i] != p:
                raise RuntimeError(f"{self.name}: page {p} to reserve is not unmapped")
            del self._unmapped[i]
            self._state[p] = BUSY
            kept = self._spare_sets.pop() if self._spare_sets else None
            if kept is None:
                self._live_sets += 1  # created by whoever maps it
            self._tp_reserve[p] = _Ahead(kept)
        self._cond.notify_all()

    def tp_ahead_job(self) -> tuple[int, list[int] | None] | None:
        """(page, kept handle set or None) of the lowest reserved page nobody maps yet, now
        marked in flight (call under the lock); None when there is none."""
        for p in sorted(self._tp_reserve):
            a = self._tp_reserve[p]
            if not a.mapped and not a.in_flight:
                a.in_flight = True
                self._busy += 1
                return p, a.handles
        return None

    def tp_ahead_map(self, p: int, handles: list[int] | None) -> None:
        """Map reserved page `p` (a job from tp_ahead_job), driver calls outside the lock."""
        fresh = handles is None
        t0 = time.perf_counter()
        try:
            if handles is None:
                handles = self._pages.create_set()
            try:
                self._pages.map_page(p, handles)
            except BaseException:
                if fresh:
                    self._pages.release_set(handles)
                raise
        except BaseException:
            with self._lock:
                self._tp_reserve[p].in_flight = False
                self._busy -= 1
                self._cond.notify_all()
            raise
        seconds = time.perf_counter() - t0
        with self._lock:
            a = self._tp_reserve[p]
            a.handles, a.mapped, a.in_flight = handles, True, False
            self._busy -= 1
            if fresh:
                self._emit(PoolEvent.HANDLES_CREATED, 1)
            self._emit(PoolEvent.PAGES_MAPPED, 1, seconds)
            self._cond.notify_all()

    def tp_publish_locked(self, pages: list[int]) -> None:
        """Make reserved `pages` allocatable, in order; map here any not mapped yet."""
        for p in pages:
            while self._tp_reserve[p].in_flight:
                self._cond.wait(timeout=1.0)
            a = self._tp_reserve[p]
            if not a.mapped:
                self._tp_ahead_map_locked(p, a)
            del self._tp_reserve[p]
            assert a.handles is not None
            self._set_mapped(p, a.handles)

    def _tp_ahead_map_locked(self, p: int, a: _Ahead) -> None:
        fresh = a.handles is None
        t0 = time.perf_counter()
        handles = self._pages.create_set() if a.handles is None else a.handles
        try:
            self._pages.map_page(p, handles)
        except BaseException:
            if fresh:
                with contextlib.suppress(Exception):
                    self._pages.release_set(handles)
            raise
        a.handles, a.mapped = handles, True
        if fresh:
            self._emit(PoolEvent.HANDLES_CREATED, 1)
        self._emit(PoolEvent.PAGES_MAPPED, 1, time.perf_counter() - t0)

    def tp_ahead_idle(self) -> bool:
        """Every reserved page mapped (call under the lock)."""
        return all(a.mapped for a in self._tp_reserve.values())

    def tp_drop_reserve_locked(self) -> None:
        """Give every reserved page back (detach, close): unmapped, its set kept or released."""
        while any(a.in_flight for a in self._tp_reserve.values()):
            self._cond.wait(timeout=1.0)
        first: BaseException | None = None
        for p in sorted(self._tp_reserve):
            a = self._tp_reserve.pop(p)
            if a.mapped:
                try:
                    self._pages.unmap_page(p)
                except BaseException as e:
                    first = first or e
                self._emit(PoolEvent.PAGES_UNMAPPED, 1)
            if a.handles is None:
                self._live_sets -= 1  # counted, never created
            elif len(self._spare_sets) < self.handle_pool_pages:
                self._spare_sets.append(a.handles)
            else:
                try:
                    self._pages.release_set(a.handles)
                except BaseException as e:
                    first = first or e
                self._live_sets -= 1
                self._emit(PoolEvent.HANDLES_RELEASED, 1)
            self._state[p] = UNMAPPED
            bisect.insort(self._unmapped, p)
        self._cond.notify_all()
        if first is not None:
            raise first

    # -- tiers ------------------------------------------------------------------------------------
    def _home(self, i: int) -> int:
        return self._home_of[i]

    def _retier(self, p: int) -> None:
        if self._state[p] != MAPPED:
            self._empty.pop(p, None)
            self._partial.pop(p, None)
        elif self._refcount[p] == 0:
            self._partial.pop(p, None)
            self._empty[p] = None
        else:
            self._empty.pop(p, None)
            if self._has_usable(p):
                self._partial[p] = None
            else:
                self._partial.pop(p, None)

    # -- lifetime -----------------------------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ClosedError(f"{self.name}.{op}: the pool is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free every slot, unmap every page, release every handle and reservation. Idempotent.

        Tensors handed out by this pool must not be used afterwards. A background mapper still
        attached is stopped first (outside the lock: its thread may be waiting for it).
        """
        mapper = self._mapper
        if mapper is not None:
            mapper.close()
        tp = self._tp
        if tp is not None:  # a TP coordinator gives back its pages mapped ahead and detaches
            tp.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            while self._busy:  # a background step is calling the driver; let it finish
                self._cond.wait(timeout=1.0)
            errors: list[BaseException] = []
            self._occupied_count = 0
            self._report_slots_locked()
            self._observer.detach(self.report_slots)
            mapped = [p for p, s in enumerate(self._state) if s == MAPPED]
            for p in mapped:
                try:
                    self._pages.unmap_page(p)
                except BaseException as e:
                    errors.append(e)
                self._state[p] = UNMAPPED
            if mapped:
                self._emit(PoolEvent.PAGES_UNMAPPED, len(mapped))
            sets = [h for h in self._handles if h is not None] + self._spare_sets
            self._handles = [None] * len(self._handles)
            self._spare_sets = []
            for handles in sets:
                try:
                    self._pages.release_set(handles)
                except BaseException as e:
                    errors.append(e)
            released = self._live_sets
            self._live_sets = 0
            if released:
                self._emit(PoolEvent.HANDLES_RELEASED, released)
            self.tensors = []
            try:
                self._pages.free_reservations()
            except BaseException as e:
                errors.append(e)
            if errors:
                raise errors[0]

    def __enter__(self) -> SwaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ahead:
    """A TP page reserved ahead: its handle set (None: not created yet), mapped, in flight."""

    __slots__ = ("handles", "in_flight", "mapped")

    def __init__(self, handles: list[int] | None) -> None:
        self.handles = handles
        self.mapped = False
        self.in_flight = False


def _as_list(ids: Any) -> list[int]:
    dtype = getattr(ids, "dtype", None)
    if dtype is not None and hasattr(ids, "tolist"):
        # A tensor (or array): one check of its dtype instead of one per element.
        if (
            getattr(dtype, "is_floating_point", False)
            or getattr(dtype, "is_complex", False)
            or str(dtype) in ("torch.bool", "bool")
        ):
            raise SlotError(f"slot ids of dtype {dtype}, expected an integer dtype")
        out = ids.tolist()
        if not isinstance(out, list):
            out = [out]
        if not out or type(out[0]) is int:
            return out
    elif isinstance(ids, int):
        out = [ids]
    elif isinstance(ids, Iterable):
        out = list(ids)
    else:
        raise SlotError(f"ids={ids!r}, expected a tensor, a sequence of ints or an int")
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            raise SlotError(f"slot id {i!r} is not an int")
    return out
