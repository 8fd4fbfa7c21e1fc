"""The page store's side of tensor-parallel page agreement (allocator.tp has the protocol).

Under TP the store runs no background mapper: every change of the allocatable pages happens
inside an alloc or a free, where it is a function of the operation sequence. `store.tp` is
the rank's coordinator: on rank 0 it lets the slot allocator's policy plan and sends the plan
to the peers; on a peer it returns rank 0's plan instead.

Pages mapped ahead (TpCoordinator(ahead_pages=k)): rank 0 announces reserved pages at an
exchange; every rank marks them at the same point of the operation sequence (out of
`unmapped`, state BUSY, a handle set counted: so every decision stays a function of the
sequence), its coordinator's thread maps them off the allocation path, and a later exchange
publishes them (MAPPED, allocatable), mapping here any the thread has not.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from accounting.events import PoolEvent

if TYPE_CHECKING:
    from allocator.pages import LayerSet

_UNMAPPED, _MAPPED, _BUSY = 0, 1, 2  # allocator.store's states


class Ahead:
    """A TP page reserved ahead: its handle set (None: not created yet), mapped, in flight."""

    __slots__ = ("handles", "in_flight", "mapped")

    def __init__(self, handles: list[int] | None) -> None:
        self.handles = handles
        self.mapped = False
        self.in_flight = False


class TpPages:
    """Mixed into allocator.store.PageStore; the attributes below are the store's."""

    if TYPE_CHECKING:
        name: str
        tp: Any
        cond: threading.Condition
        state: bytearray
        unmapped: list[int]
        kept: list[list[int]]
        live_sets: int
        busy: int
        occupied: int
        spares: dict[int, None]
        tp_reserve: dict[int, Any]
        handle_pool_pages: int
        max_spare_pages: int
        pages: LayerSet

        def emit(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None: ...
        def set_mapped(self, p: int, handles: list[int]) -> None: ...
        def unmap_spare_locked(self, p: int) -> bool: ...
        def _changed(self, pages: Any) -> None: ...

    def tp_trim_locked(self) -> None:
        excess = len(self.spares) - self.max_spare_pages
        for p in self.tp.plan_unmap(excess):
            self.unmap_spare_locked(p)

    def tp_trim_plan(self, excess: int) -> list[int]:
        """The spare pages a trim unmaps to drop `excess` of them, in order."""
        return list(reversed(self.spares))[:excess]

    def tp_state(self) -> dict[str, int]:
        """The figures every rank compares at an exchange (call under the lock)."""
        return {
            "occupied_slots": self.occupied,
            "mapped_pages": self.state.count(_MAPPED),
            "spare_pages": len(self.spares),
            "live_handle_sets": self.live_sets,
            "reserved_pages": len(self.tp_reserve),
        }

    def tp_page_state(self, page: int) -> str:
        """'unmapped', 'reserved' (announced ahead), 'spare' (mapped, not in use), 'used' or
        'busy'."""
        if page in self.tp_reserve:
            return "reserved"
        if self.state[page] == _BUSY:
            return "busy"
        if self.state[page] == _UNMAPPED:
            return "unmapped"
        return "spare" if page in self.spares else "used"

    def tp_reserve_locked(self, pages: list[int]) -> None:
        for p in pages:
            i = bisect.bisect_left(self.unmapped, p)
            if i == len(self.unmapped) or self.unmapped[i] != p:
                raise RuntimeError(f"{self.name}: page {p} to reserve is not unmapped")
            del self.unmapped[i]
            self.state[p] = _BUSY
            kept = self.kept.pop() if self.kept else None
            if kept is None:
                self.live_sets += 1  # created by whoever maps it
            self.tp_reserve[p] = Ahead(kept)
        self.cond.notify_all()

    def tp_ahead_job(self) -> tuple[int, list[int] | None] | None:
        """(page, kept handle set or None) of the lowest reserved page nobody maps yet, now
        marked in flight (call under the lock); None when there is none."""
        for p in sorted(self.tp_reserve):
            a = self.tp_reserve[p]
            if not a.mapped and not a.in_flight:
                a.in_flight = True
                self.busy += 1
                return p, a.handles
        return None

    def tp_ahead_map(self, p: int, handles: list[int] | None) -> None:
        """Map reserved page `p` (a job from tp_ahead_job), driver calls outside the lock."""
        fresh = handles is None
        t0 = time.perf_counter()
        try:
            if handles is None:
                handles = self.pages.create_set()
            try:
                self.pages.map_page(p, handles)
            except BaseException:
                if fresh:
                    self.pages.release_set(handles)
                raise
        except BaseException:
            with self.cond:
                self.tp_reserve[p].in_flight = False
                self.busy -= 1
                self.cond.notify_all()
            raise
        seconds = time.perf_counter() - t0
        with self.cond:
            a = self.tp_reserve[p]
            a.handles, a.mapped, a.in_flight = handles, True, False
            self.busy -= 1
            if fresh:
                self.emit(PoolEvent.HANDLES_CREATED, 1)
            self.emit(PoolEvent.PAGES_MAPPED, 1, seconds)
            self.cond.notify_all()

    def tp_publish_locked(self, pages: list[int]) -> None:
        """Make reserved `pages` allocatable, in order; map here any not mapped yet."""
        for p in pages:
            while self.tp_reserve[p].in_flight:
                self.cond.wait(timeout=1.0)
            a = self.tp_reserve[p]
            if not a.mapped:
                self._tp_ahead_map_locked(p, a)
            del self.tp_reserve[p]
            assert a.handles is not None
            self.set_mapped(p, a.handles)
            self._changed((p,))

    def _tp_ahead_map_locked(self, p: int, a: Ahead) -> None:
        fresh = a.handles is None
        t0 = time.perf_counter()
        handles = self.pages.create_set() if a.handles is None else a.handles
        try:
            self.pages.map_page(p, handles)
        except BaseException:
            if fresh:
                with contextlib.suppress(Exception):
                    self.pages.release_set(handles)
            raise
        a.handles, a.mapped = handles, True
        if fresh:
            self.emit(PoolEvent.HANDLES_CREATED, 1)
        self.emit(PoolEvent.PAGES_MAPPED, 1, time.perf_counter() - t0)

    def tp_ahead_idle(self) -> bool:
        """Every reserved page mapped (call under the lock)."""
        return all(a.mapped for a in self.tp_reserve.values())

    def tp_drop_reserve_locked(self) -> None:
        """Give every reserved page back (detach, close): unmapped, its set kept or released."""
        while any(a.in_flight for a in self.tp_reserve.values()):
            self.cond.wait(timeout=1.0)
        first: BaseException | None = None
        for p in sorted(self.tp_reserve):
            a = self.tp_reserve.pop(p)
            if a.mapped:
                try:
                    self.pages.unmap_page(p)
                except BaseException as e:
                    first = first or e
                self.emit(PoolEvent.PAGES_UNMAPPED, 1)
            if a.handles is None:
                self.live_sets -= 1  # counted, never created
            elif len(self.kept) < self.handle_pool_pages:
                self.kept.append(a.handles)
            else:
                try:
                    self.pages.release_set(a.handles)
                except BaseException as e:
                    first = first or e
                self.live_sets -= 1
                self.emit(PoolEvent.HANDLES_RELEASED, 1)
            self.state[p] = _UNMAPPED
            bisect.insort(self.unmapped, p)
        self.cond.notify_all()
        if first is not None:
            raise first
