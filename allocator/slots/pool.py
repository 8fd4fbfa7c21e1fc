"""kvledger's token-slot allocator on a page store: slots handed out, pages mapped to match.

`SwaPool` lays slots out in rows over every layer buffer (allocator.slots.layout) and keeps
which slots are occupied; its `gather` (allocator.slots.gather, given the store) keeps, per
page id, the slots whose bytes lie in it (a slot may straddle into the next page: it is that
page's *tail*) and the tiers an allocation draws from. A page is in use while any occupied
slot touches it; the page store (allocator.store) maps, unmaps and keeps spares by that.

Allocation takes slots from partly occupied pages first, then from spare pages, and only
then maps new pages. Nothing changes unless the whole request can be met. The occupied-slot
figure is reported through the store (accounting.events), so an allocation costs the
observer nothing. See docs/allocator.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accounting.events import PoolObserver
from allocator.backend import Backend
from allocator.slots.gather import SlotGather
from allocator.slots.layout import SlotLayout
from allocator.slots.slot_ids import as_id_list, validate
from allocator.states import PageState
from allocator.store import PageStore, StoreState

__all__ = ["PoolState", "SwaPool", "as_id_list"]


@dataclass(frozen=True)
class PoolState:
    """A pool's books at one instant (`SwaPool.debug_state`), for tests.

    `store`: its page store's (`StoreState`); `occupied`: one byte per slot, 1 while handed
    out (the null slot included); `refcount`: per page id the occupied slots touching it;
    `free_inner`: per page id its free slots other than its tail, ascending; `tail_free`: per
    page id 1 while its tail slot (straddling into the next page) is free; `partial`: the page
    ids of the partial tier, ascending."""

    store: StoreState
    occupied: bytes
    refcount: tuple[int, ...]
    free_inner: tuple[tuple[int, ...], ...]
    tail_free: bytes
    partial: tuple[int, ...]


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
        unmap_grace_s: float = 0.0,
        null_slot: bool = True,
        observer: PoolObserver | None = None,
        name: str = "swa",
    ) -> None:
        self.name = name
        self.layout = layout
        self.layers = layers
        self.page_bytes = layout.page_bytes
        self._occupied = bytearray(layout.capacity_slots)
        self.null_slot = 0 if null_slot else None
        self.store = store = PageStore(
            backend,
            layers=layers,
            page_bytes=layout.page_bytes,
            num_pages=layout.num_pages,
            physical_budget=physical_budget,
            min_spare_pages=min_spare_pages,
            max_spare_pages=max_spare_pages,
            handle_pool_pages=handle_pool_pages,
            unmap_grace_s=unmap_grace_s,
            observer=observer,
            name=name,
        )
        self.gather = SlotGather(store, layout, capacity_slots=self.capacity_slots, name=name)
        with store.lock:
            store.attach_user(self.gather)
        try:
            self.tensors = [store.byte_tensor(i, layout.buffer_bytes) for i in range(layers)]
        except BaseException:
            store.close()
            raise
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
        return self.store.policy.max_spare_pages

    @property
    def min_spare_pages(self) -> int:
        return self.store.policy.min_spare_pages

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
            due = store.reporter.tick()
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
                store.policy.after_release_locked()
            else:
                self._tp_run("free", len(slots), lambda: self._tp_free_locked(slots))
            due = store.reporter.tick()
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
            due = store.reporter.tick()
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

    def debug_state(self) -> PoolState:
        """A copy of the pool's books and its store's (`PoolState`), for tests. Takes the
        store's lock."""
        g = self.gather
        with self.store.lock:
            return PoolState(
                store=self.store.debug_state(),
                occupied=bytes(self._occupied),
                refcount=tuple(g.refcount),
                free_inner=tuple(tuple(sorted(s)) for s in g.free_inner),
                tail_free=bytes(g.tail_free),
                partial=tuple(sorted(g.partial)),
            )

    # -- allocation ------------------------------------------------------------------------
    def _alloc_locked(self, n: int) -> list[int]:
        store, gather = self.store, self.gather
        while True:
            taken: list[int] = []
            gather.gather(n, taken)
            if len(taken) == n:
                break
            need = n - len(taken)
            try:
                plan = gather.plan_pages(need) if store.tp is None else store.tp.plan_map(need)
            except BaseException:  # CapacityError: give back what was gathered
                gather.return_gathered(taken)
                raise
            if plan is None:  # the mapper holds pages we would need: wait for it, then retry
                gather.return_gathered(taken)
                store.cond.wait(timeout=1.0)
                store.check_open("alloc")
                continue
            try:
                store.map_locked(plan, f"allocate {need} slots ({len(plan)} new page ids)")
            except BaseException:
                gather.return_gathered(taken)
                raise
            gather.gather(n, taken)
            if len(taken) != n:  # pragma: no cover - the plan guarantees enough slots
                gather.return_gathered(taken)
                raise RuntimeError(f"alloc: planned pages {plan} yielded {len(taken)} of {n} slots")
            break
        self._commit(taken)
        return taken

    def _commit(self, taken: list[int]) -> None:
        occupied = self._occupied
        for i in taken:
            occupied[i] = 1
        self.gather.hold(taken)
        store = self.store
        store.reporter.add_occupied(len(taken))
        if len(store.spares) < store.policy.min_spare_pages:
            store.cond.notify_all()

    # -- follow mode ------------------------------------------------------------------------
    def _occupy_locked(self, slots: list[int], *, count: bool) -> None:
        store = self.store
        mapped, busy = PageState.MAPPED, PageState.BUSY
        while True:
            # (re)checked after every wait: another thread may have taken an id meanwhile
            self._validate(slots, "occupy", want_occupied=False)
            missing = sorted(
                {
                    p
                    for i in slots
                    for p in set(self.layout.slot_pages(i))
                    if store.state[p] != mapped
                }
            )
            if any(store.state[p] == busy for p in missing):
                store.cond.wait(timeout=1.0)
                store.check_open("occupy")
                continue
            break
        if missing:
            store.map_locked(missing, f"occupy {len(slots)} slots ({len(missing)} new page ids)")
        self.gather.claim(slots)
        if count:
            self._commit(slots)
        else:  # the null slot: held, never counted as a live request's
            for i in slots:
                self._occupied[i] = 1
            self.gather.hold(slots)

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
        occupied = self._occupied
        for i in slots:
            occupied[i] = 0
        self.gather.release(slots)
        self.store.reporter.add_occupied(-len(slots))

    # -- tensor parallelism (driven by allocator.tp; the coordinator's docstring has the protocol)
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
        self.store.policy.after_release_locked()
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
            store.policy.max_spare_pages,
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
