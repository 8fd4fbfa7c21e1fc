"""kvledger's token-slot allocator on a page store: slots handed out, pages mapped to match.

`SwaPool` lays slots out in rows over every layer buffer (allocator.layout) and keeps,
per page id, the slots whose bytes lie in it (a slot may straddle into the next page: it is
that page's *tail*). A page is in use while any occupied slot touches it; the page store
(allocator.store) maps, unmaps and keeps spares by that.

Allocation takes slots from partly occupied pages first, then from spare pages, and only
then maps new pages. Nothing changes unless the whole request can be met. The occupied-slot
figure is reported through the store (accounting.events), so an allocation costs the
observer nothing. See docs/allocator.md.
"""

from __future__ import annotations

from typing import Any

from accounting.events import PoolObserver
from allocator.backend import Backend
from allocator.gather import SlotGather
from allocator.layout import SlotLayout
from allocator.slot_ids import as_id_list, validate
from allocator.store import BUSY, MAPPED, PageStore

__all__ = ["SwaPool", "as_id_list"]


class SwaPool(SlotGather):
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
        unmap_grace_s: float = 0.0,
        null_slot: bool = True,
        observer: PoolObserver | None = None,
        name: str = "swa",
    ) -> None:
        self.name = name
        self.layout = layout
        self.layers = layers
        self.page_bytes = layout.page_bytes
        n_pages = layout.num_pages
        self._refcount = [0] * n_pages
        # home_of[i]: the page holding slot i's first byte; a slot that straddles into
        # home + 1 is that page's tail. free_inner[p]: the free slots of p other than its tail.
        self._home_of, self._tail, self._free_inner = layout.page_index()
        self._tail_free = bytearray(1 if t >= 0 else 0 for t in self._tail)
        self._occupied = bytearray(layout.capacity_slots)
        self._partial: dict[int, None] = {}  # mapped, in use, maybe usable free slots
        self.store = store = PageStore(
            backend,
            layers=layers,
            page_bytes=layout.page_bytes,
            num_pages=n_pages,
            physical_budget=physical_budget,
            min_spare_pages=min_spare_pages,
            max_spare_pages=max_spare_pages,
            handle_pool_pages=handle_pool_pages,
            unmap_grace_s=unmap_grace_s,
            observer=observer,
            name=name,
        )
        store.user = self
        try:
            self.tensors = [store.byte_tensor(i, layout.buffer_bytes) for i in range(layers)]
        except BaseException:
            store.close()
            raise
        self.null_slot = 0 if null_slot else None
        if null_slot:
            try:
                with store.lock:
                    self._occupy_locked([0], count=False)
            except BaseException:
                self.close()
                raise

    @property
    def capacity_slots(self) -> int:
        """Slots that can be handed out (the null slot excluded)."""
        return self.layout.capacity_slots - (self.null_slot is not None)

    @property
    def physical_budget(self) -> int | None:
        return self.store.physical_budget

    @property
    def max_spare_pages(self) -> int:
        return self.store.max_spare_pages

    @property
    def min_spare_pages(self) -> int:
        return self.store.min_spare_pages

    @property
    def handle_pool_pages(self) -> int:
        return self.store.handle_pool_pages

    @property
    def set_bytes(self) -> int:
        return self.store.set_bytes

    # -- public API ------------------------------------------------------------------------
    def alloc(self, n: int) -> Any:
        """Hand out `n` free slots as an int64 tensor; maps pages if it must. All or nothing."""
        import torch

        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"alloc: n={n!r}, expected a non-negative int")
        store = self.store
        with store.lock:
            store.check_open("alloc")
            if store.tp is None:
                taken = self._alloc_locked(n)
            else:
                taken = self._tp_run("alloc", n, lambda: self._alloc_locked(n))
            due = store.tick()
        if due:
            store.safe_point()
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, ids: Any) -> None:
        """Return slots. Double frees, the null slot and ids out of range raise; nothing changes.
        Pages that empty are unmapped by the store's policy; an unmap that fails is counted
        and retried later, never raised here."""
        slots = as_id_list(ids)
        store = self.store
        with store.lock:
            store.check_open("free")
            self._validate(slots, "free", want_occupied=True)
            if store.tp is None:
                self._free_locked(slots)
                store.after_release_locked()
            else:
                self._tp_run("free", len(slots), lambda: self._tp_free_locked(slots))
            due = store.tick()
        if due:
            store.safe_point()

    def occupy(self, ids: Any) -> None:
        """Follow ids chosen elsewhere (an engine's allocator, TP rank 0): mark them occupied,
        mapping the pages they need. All or nothing."""
        slots = as_id_list(ids)
        store = self.store
        with store.lock:
            store.check_open("occupy")
            if store.tp is not None:
                raise RuntimeError(
                    f"{self.name}.occupy: not supported while the pool follows a TP group "
                    "(allocator.tp); use alloc/free on every rank"
                )
            self._occupy_locked(slots, count=True)
            due = store.tick()
        if due:
            store.safe_point()

    def report_slots(self) -> None:
        self.store.report_slots()

    def buffer(self, layer: int, dtype: Any = None, shape: tuple[int, ...] | None = None) -> Any:
        """Layer `layer`'s buffer viewed as `dtype` in `shape` (default: rows x row bytes)."""
        self.store.check_open("buffer")
        t = self.tensors[layer]
        if dtype is not None:
            t = t.view(dtype)
        return t.view(shape if shape is not None else (self.layout.rows, -1))

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    def is_page_mapped(self, page: int) -> bool:
        return self.store.is_mapped(page)

    def occupied_ids(self) -> list[int]:
        with self.store.lock:
            return [i for i, o in enumerate(self._occupied) if o and i != self.null_slot]

    # -- allocation ------------------------------------------------------------------------
    def _alloc_locked(self, n: int) -> list[int]:
        store = self.store
        while True:
            taken: list[int] = []
            self._gather(n, taken)
            if len(taken) == n:
                break
            need = n - len(taken)
            try:
                plan = self.plan_pages(need) if store.tp is None else store.tp.plan_map(need)
            except BaseException:  # CapacityError: give back what was gathered
                self._return_gathered(taken)
                raise
            if plan is None:  # the mapper holds pages we would need: wait for it, then retry
                self._return_gathered(taken)
                store.cond.wait(timeout=1.0)
                store.check_open("alloc")
                continue
            try:
                store.map_locked(plan)
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
        store = self.store
        store.add_occupied(len(taken))
        if len(store.spares) < store.min_spare_pages:
            store.cond.notify_all()

    # -- follow mode ------------------------------------------------------------------------
    def _occupy_locked(self, slots: list[int], *, count: bool) -> None:
        store = self.store
        while True:
            # (re)checked after every wait: another thread may have taken an id meanwhile
            self._validate(slots, "occupy", want_occupied=False)
            missing = sorted(
                {
                    p
                    for i in slots
                    for p in set(self.layout.slot_pages(i))
                    if store.state[p] != MAPPED
                }
            )
            if any(store.state[p] == BUSY for p in missing):
                store.cond.wait(timeout=1.0)
                store.check_open("occupy")
                continue
            break
        if missing:
            store.check_budget(
                store.sets_needed(missing),
                f"occupy {len(slots)} slots ({len(missing)} new page ids)",
            )
            store.map_locked(missing)
        touched = set()
        for i in slots:
            a = self._home_of[i]
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
            for i in slots:
                self._occupied[i] = 1
                for p in set(self.layout.slot_pages(i)):
                    self._refcount[p] += 1
                    self._retier(p)

    # -- free ---------------------------------------------------------------------------------
    def _validate(self, slots: list[int], op: str, *, want_occupied: bool) -> None:
        validate(
            slots,
            op,
            occupied=self._occupied,
            null=self.null_slot,
            name=self.name,
            want_occupied=want_occupied,
        )

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
        self.store.add_occupied(-len(slots))

    # -- tensor parallelism (driven by allocator.tp; its docstring has the protocol) -----------
    def _tp_run(self, op: str, n: int, body: Any) -> list[int]:
        tp = self.store.tp
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
        self.store.after_release_locked()
        return slots

    def tp_config(self) -> tuple[int, ...]:
        """What must be equal on every rank for the ranks to make the same choices."""
        store = self.store
        return (
            self.layers,
            self.page_bytes,
            self.layout.capacity_slots,
            self.layout.slot_bytes,
            self.layout.slots_per_row,
            self.layout.row_bytes,
            store.max_spare_pages,
            store.handle_pool_pages,
            -1 if store.physical_budget is None else store.physical_budget,
            -1 if self.null_slot is None else self.null_slot,
        )

    # -- lifetime -----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.store.closed

    def close(self) -> None:
        """Free every slot, unmap every page, release every handle and reservation. Idempotent;
        always completes (allocator.store). Tensors handed out must not be used afterwards."""
        self.store.close()
        self.tensors = []

    def __enter__(self) -> SwaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
