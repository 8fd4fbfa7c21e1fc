"""The page store: page ids of a set of layer buffers, mapped and unmapped as whole transactions.

A page id `p` is the same byte range in every layer's reservation (allocator.pages). Its
state is UNMAPPED, MAPPED, or BUSY (a background step is calling the driver for it outside
the lock). A slot allocator on top (allocator.pool's `SwaPool`, allocator.rows'
`RowFollower`) decides which pages its occupants use and tells the store with `set_use`; a
MAPPED page not in use is a *spare*. The store owns the rest:

- handle sets: one handle per layer makes a page id's memory; sets of unmapped pages are
  kept (up to `handle_pool_pages`) for the next map; every set alive counts against
  `physical_budget`;
- map transactions (`map_locked`): all pages of a plan or none, undone on any failure;
- the spare policy: keep at least `min_spare_pages` mapped ahead (background mapper),
  unmap spares beyond `max_spare_pages` once they have stayed beyond it for
  `unmap_grace_s` seconds (hysteresis), at once beyond `max_spare_pages + grace_pages`
  (the hysteresis is bounded in count too), never a page whose fence has not signalled
  (CUDA: the GPU work that last used it), the most recently emptied first;
- map-ahead (`set_ahead`): pages a follower expects to hand out next are mapped by the
  background mapper before they are asked for; pins (`pin`): pages that may be handed out
  before the follower hears of it are never unmapped;
- failures: a failed driver call is counted (`failures`, `PoolEvent.DRIVER_FAILURES`) and
  logged rate-limited (allocator.faillog); an unmap that fails leaves the page whole and
  mapped, to be retried, and never raises out of a free; `close()` always completes.

Every change of handles and mappings is reported to the observer after it happened
(accounting.events), the occupant count first. See docs/allocator.md.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from accounting.events import PoolEvent, PoolObserver
from allocator.backend import Backend
from allocator.checks import check_count
from allocator.errors import CapacityError, ClosedError
from allocator.faillog import FailureLog
from allocator.pages import LayerSet
from allocator.reporting import Reporter, _NullObserver
from allocator.spares import SparePolicy
from allocator.tp_pages import TpPages

UNMAPPED, MAPPED, BUSY = 0, 1, 2

RETRY_AFTER_FAILURE_S = 1.0  # a failed unmap is retried by a release no sooner than this


class PageUser(Protocol):
    def pages_changed(self, pages: Iterable[int]) -> None:
        """Pages changed state (mapped, unmapped, busy); called under the store's lock."""


class Fence(Protocol):
    """GPU work that used a page (a CUDA event recorded at give-back); host: always done."""

    def done(self) -> bool: ...
    def wait(self) -> None: ...


class PageStore(Reporter, SparePolicy, TpPages):
    def __init__(
        self,
        backend: Backend,
        *,
        layers: int,
        page_bytes: int,
        num_pages: int,
        physical_budget: int | None = None,
        min_spare_pages: int = 0,
        max_spare_pages: int = 1,
        handle_pool_pages: int | None = None,
        unmap_grace_s: float = 0.0,
        grace_pages: int = 1,
        observer: PoolObserver | None = None,
        name: str = "swa",
    ) -> None:
        if page_bytes % backend.granularity:
            raise ValueError(
                f"page_bytes={page_bytes}, expected a multiple of the backend granularity "
                f"{backend.granularity}"
            )
        if not 0 <= min_spare_pages <= max_spare_pages:
            raise ValueError(
                f"min_spare_pages={min_spare_pages}, max_spare_pages={max_spare_pages}: "
                "expected 0 <= min_spare_pages <= max_spare_pages"
            )
        check_count("grace_pages", grace_pages, 0)
        if not (isinstance(unmap_grace_s, (int, float)) and math.isfinite(unmap_grace_s)) or (
            unmap_grace_s < 0
        ):
            raise ValueError(f"unmap_grace_s={unmap_grace_s!r}, expected a finite number >= 0")
        self.name = name
        self.layers = layers
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.set_bytes = layers * page_bytes  # physical bytes of one page id
        if physical_budget is not None and physical_budget < self.set_bytes:
            raise ValueError(
                f"physical_budget={physical_budget}, expected at least one page id "
                f"({layers} layers x {page_bytes} bytes = {self.set_bytes})"
            )
        self.physical_budget = physical_budget
        self.min_spare_pages = min_spare_pages
        self.max_spare_pages = max_spare_pages
        self.handle_pool_pages = max_spare_pages if handle_pool_pages is None else handle_pool_pages
        self.unmap_grace_s = float(unmap_grace_s)
        self.grace_pages = grace_pages
        self.observer: PoolObserver = observer or _NullObserver()
        # Reentrant: a ledger snapshot taken by a thread that holds it (to read the store and
        # the ledger at one instant) flushes the occupant figure through `report_slots`.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self.state = bytearray(num_pages)
        self.handles: list[list[int] | None] = [None] * num_pages
        self.in_use = bytearray(num_pages)
        self.spares: dict[int, None] = {}  # MAPPED, not in use; in the order they emptied
        self.unmapped: list[int] = list(range(num_pages))  # kept sorted
        self.kept: list[list[int]] = []  # handle sets kept unmapped
        self.live_sets = 0  # mapped + kept + being created
        self.busy = 0
        self.occupied = 0  # the occupant count (slots, rows) the user reports
        self._peak = 0
        self._reported = 0
        self._calls = 0
        self.pages_mapped_total = 0  # page ids mapped / unmapped since construction
        self.pages_unmapped_total = 0
        self.user: PageUser | None = None
        self.mapper: Any = None  # allocator.mapper.BackgroundMapper, when one runs
        self.tp: Any = None  # allocator.tp.TpCoordinator, when the store follows a TP group
        self.tp_reserve: dict[int, Any] = {}  # TP pages announced ahead (allocator.tp_pages)
        self.ahead: dict[int, None] = {}  # pages a follower hands out next: map them ahead
        # Pages an engine may hand out before its follower hears of it: never unmapped.
        self.pinned: dict[int, None] = {}
        self.fences: dict[int, Fence] = {}  # spare page -> the GPU work that last used it
        self.failures = FailureLog(name)
        self._over_since: float | None = None  # when spares last rose above max_spare_pages
        self.retry_after_s = RETRY_AFTER_FAILURE_S
        self._retry_at = 0.0
        # First, so an observer that refuses (an account another pool follows) costs nothing.
        self.observer.attach(self.report_slots)
        try:
            self.pages = LayerSet(
                backend, layers=layers, reserved_bytes=num_pages * page_bytes, page_bytes=page_bytes
            )
        except BaseException:
            self.observer.detach(self.report_slots)
            raise

    # -- use and spares -----------------------------------------------------------------------
    def set_use(self, p: int, used: bool) -> None:
        """The user's occupants of page `p` went from none to some (True) or back (False)."""
        self.in_use[p] = used
        if used:
            if self.spares.pop(p, 0) is None and len(self.spares) <= self.max_spare_pages:
                self._over_since = None  # back within the watermark: the grace starts over
            self.fences.pop(p, None)
        elif self.state[p] == MAPPED:
            self.spares[p] = None

    def fence(self, pages: Iterable[int], fence: Fence) -> None:
        """Spare `pages` may not be unmapped before `fence` is done (under the lock)."""
        for p in pages:
            if p in self.spares:
                self.fences[p] = fence

    def set_ahead(self, pages: Iterable[int]) -> None:
        """The pages a follower will hand out next; the mapper keeps them mapped."""
        self.ahead = dict.fromkeys(pages)
        if self.ahead_room() and any(self.state[p] == UNMAPPED for p in self.ahead):
            self.cond.notify_all()  # the mapper has work (waking it costs this thread the GIL)

    def pin(self, pages: Iterable[int]) -> None:
        """Pages that must stay mapped whether in use or not (under the lock): a follower that
        learns of allocations late (kvledger.sglang.bridge.journal) pins the pages of the rows
        the engine may hand out meanwhile. Replaces the previous pins."""
        self.pinned = dict.fromkeys(pages)

    def is_mapped(self, p: int) -> bool:
        return 0 <= p < self.num_pages and self.state[p] == MAPPED

    def address(self, layer: int, page: int) -> int:
        return self.pages.address(layer, page)

    def byte_tensor(self, layer: int, size: int) -> Any:
        return self.pages.byte_tensor(layer, size)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "occupied_slots": self.occupied,
                "mapped_pages": self.state.count(MAPPED),
                "spare_pages": len(self.spares),
                "kept_handle_sets": len(self.kept),
                "live_handle_sets": self.live_sets,
                "physical_bytes": self.live_sets * self.set_bytes,
                "busy_pages": self.busy,
                "driver_failures": self.failures.total,
                "pages_mapped_total": self.pages_mapped_total,
                "pages_unmapped_total": self.pages_unmapped_total,
            }

    # -- budget ----------------------------------------------------------------------------------
    def sets_needed(self, plan: Iterable[int]) -> int:
        """New handle sets a map of `plan` creates (reserved TP pages hold theirs)."""
        unheld = sum(1 for p in plan if p not in self.tp_reserve)
        return max(0, unheld - len(self.kept))

    def check_budget(self, new_sets: int, what: str) -> None:
        if self.physical_budget is None or new_sets == 0:
            return
        after = (self.live_sets + new_sets) * self.set_bytes
        if after > self.physical_budget:
            raise CapacityError(
                f"{self.name}: cannot {what}: physical bytes would be {after}, over the budget "
                f"physical_budget={self.physical_budget} ({self.live_sets} page ids held, "
                f"{self.set_bytes} bytes each)"
            )

    def budget_allows(self, new_sets: int = 1) -> bool:
        return (
            self.physical_budget is None
            or (self.live_sets + new_sets) * self.set_bytes <= self.physical_budget
        )

    # -- mapping -----------------------------------------------------------------------------------
    def map_locked(self, plan: list[int]) -> None:
        """Map every page of `plan` now, under the lock. All or nothing: a failure undoes the
        pages done, is counted, and is raised (DriverError)."""
        if not plan:
            return
        done: list[tuple[int, list[int], bool]] = []
        created = 0
        t0 = time.perf_counter()
        op = "create"
        try:
            for p in plan:
                fresh = not self.kept
                op = "create"
                handles = self.pages.create_set() if fresh else self.kept.pop()
                if fresh:
                    created += 1
                    self.live_sets += 1
                op = "map"
                try:
                    self.pages.map_page(p, handles)
                except BaseException:
                    self._put_back_set(handles, fresh)
                    if fresh:
                        created -= 1
                    raise
                done.append((p, handles, fresh))
        except BaseException as e:
            for p, handles, fresh in reversed(done):
                with contextlib.suppress(Exception):
                    self.pages.unmap_page(p)
                self._put_back_set(handles, fresh)
            if isinstance(e, Exception):
                self._failed(op, e)
            raise
        seconds = time.perf_counter() - t0
        if created:
            self.emit(PoolEvent.HANDLES_CREATED, created)
        for p, handles, _ in done:
            self.set_mapped(p, handles)
        self.emit(PoolEvent.PAGES_MAPPED, len(done), seconds)
        self._changed(plan)

    def _put_back_set(self, handles: list[int], fresh: bool) -> None:
        """Undo the taking of a handle set for a map that failed."""
        if fresh:
            self.live_sets -= 1
            with contextlib.suppress(Exception):
                self.pages.release_set(handles)
        else:
            self.kept.append(handles)

    def set_mapped(self, p: int, handles: list[int]) -> None:
        """Mark `p` mapped with `handles` (its user is told by the caller: `_changed`)."""
        self.state[p] = MAPPED
        self.handles[p] = handles
        i = bisect.bisect_left(self.unmapped, p)
        if i < len(self.unmapped) and self.unmapped[i] == p:
            del self.unmapped[i]
        if not self.in_use[p]:
            self.spares[p] = None
            if len(self.spares) > self.max_spare_pages and self._over_since is None:
                # over the watermark by a map (one the mapper began while under it): the
                # grace starts now, as it would at a release, so the spare does not stay
                self._over_since = time.monotonic()

    def _changed(self, pages: Iterable[int]) -> None:
        if self.user is not None:
            self.user.pages_changed(pages)

    # -- unmapping --------------------------------------------------------------------------------
    def unmap_spare_locked(self, p: int) -> bool:
        """Unmap spare page `p` now, under the lock; keep or release its handle set. A failure
        leaves the page whole and spare, is counted and logged: returns False."""
        self.begin_unmap(p)
        t0 = time.perf_counter()
        try:
            self.pages.unmap_page(p, self.handles[p])
        except Exception as e:  # unmap_page put the page back whole
            self.abort_unmap(p)
            self._failed("unmap", e)
            return False
        except BaseException:
            self.abort_unmap(p)
            raise
        handles = self.finish_unmap(p, time.perf_counter() - t0)
        if handles is not None:
            self.release_locked(handles)
        return True

    def begin_unmap(self, p: int) -> None:
        self.state[p] = BUSY
        self.busy += 1
        self.spares.pop(p, None)
        self.fences.pop(p, None)
        self._changed((p,))

    def abort_unmap(self, p: int) -> None:
        self.state[p] = MAPPED
        self.busy -= 1
        if not self.in_use[p]:
            self.spares[p] = None
        self._changed((p,))
        self.cond.notify_all()

    def finish_unmap(self, p: int, seconds: float) -> list[int] | None:
        """Mark `p` unmapped; keep its handle set, or return it for the caller to release
        (with `release_locked`, or `release_set` outside the lock then `released_set`)."""
        handles = self.handles[p]
        assert handles is not None
        self.handles[p] = None
        self.state[p] = UNMAPPED
        bisect.insort(self.unmapped, p)
        self.emit(PoolEvent.PAGES_UNMAPPED, 1, seconds)
        self.cond.notify_all()
        if len(self.kept) < self.handle_pool_pages:
            self.kept.append(handles)
            self.busy -= 1
            return None
        return handles  # still busy until released

    def release_locked(self, handles: list[int]) -> None:
        try:
            self.pages.release_set(handles)
        except Exception as e:  # the driver keeps what it could not release; counted
            self._failed("release", e)
        finally:
            self.released_set()

    def released_set(self) -> None:
        self.busy -= 1
        self.live_sets -= 1
        self.emit(PoolEvent.HANDLES_RELEASED, 1)
        self.cond.notify_all()

    # -- lifetime ----------------------------------------------------------------------------------
    def check_open(self, op: str) -> None:
        if self.closed:
            raise ClosedError(f"{self.name}.{op}: the pool is closed")

    def close(self) -> None:
        """Unmap every page, release every handle set and reservation. Idempotent; completes
        whatever the driver says (failures are counted and logged, never raised).

        A background mapper or TP coordinator still attached is stopped first (outside the
        lock: its thread may be waiting for it); pending fences are waited for."""
        if self.mapper is not None:
            self.mapper.close()
        if self.tp is not None:  # gives back its pages mapped ahead and detaches
            self.tp.close()
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
            while self.busy:  # a background step is calling the driver; let it finish
                self.cond.wait(timeout=1.0)
            for f in list(self.fences.values()):
                f.wait()
            self.fences.clear()
            self.occupied = 0
            self.report_slots_locked()
            self.observer.detach(self.report_slots)
            mapped = [p for p, s in enumerate(self.state) if s == MAPPED]
            for p in mapped:
                try:
                    self.pages.unmap_page(p)
                except Exception as e:
                    self._failed("unmap", e)
                self.state[p] = UNMAPPED
            if mapped:
                self.emit(PoolEvent.PAGES_UNMAPPED, len(mapped))
            sets = [h for h in self.handles if h is not None] + self.kept
            self.handles = [None] * self.num_pages
            self.kept = []
            self.spares.clear()
            for handles in sets:
                try:
                    self.pages.release_set(handles)
                except Exception as e:
                    self._failed("release", e)
            released, self.live_sets = self.live_sets, 0
            if released:
                self.emit(PoolEvent.HANDLES_RELEASED, released)
            try:
                self.pages.free_reservations()
            except Exception as e:  # the backend's close frees what is left
                self._failed("free_reservation", e)

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
