"""The page store: page ids of a set of layer buffers, mapped and unmapped as whole transactions.

A page id `p` is the same byte range in every layer's reservation (allocator.pages). Its
state is an allocator.states.PageState: UNMAPPED, MAPPED, or BUSY (in a transaction the lock
does not cover). The store's *user*, a slot allocator on top (allocator.slots' `SwaPool`,
allocator.rows' `RowFollower`), decides which pages its occupants use and says so with
`set_use`; a MAPPED page not in use is a *spare*. The store owns:

- the page books: states, which pages are in use, the spares (in the order they emptied),
  the unmapped pages (sorted);
- handle sets: one handle per layer makes a page id's memory; sets of unmapped pages are
  kept (up to `handle_pool_pages`) for the next map; every set alive counts against
  `physical_budget`, and a map that would go over it raises CapacityError, changing nothing;
- the map and the unmap transaction (below), the one way every page changes: mapped on an
  allocation, ahead by the background mapper, ahead by a TP rank, unmapped by a trim;
- failures: a failed driver call is counted and logged rate-limited (allocator.faillog);
  an unmap that fails leaves the page whole and mapped, to be retried, and never raises out
  of a free; `close()` always completes.

It holds two objects it hands itself to: `policy` (allocator.spares.SparePolicy: what to
unmap when, what to map ahead, pins, fences; its callers, the followers and the SGLang
bridge, use it as `store.policy`; it sees the store as an allocator.spares.SpareStore) and `reporter` (allocator.reporting.Reporter:
the occupant figure and every event to the observer, accounting.events, after it happened).
Three parties attach to it, each through its own attach/detach method: the user, a
background mapper (allocator.mapper) and a TP coordinator (allocator.tp).

Lock protocol
    `lock` (reentrant: a ledger snapshot taken by a thread that holds it flushes the
    occupant figure through `report_slots`) guards the books, the policy's and the
    reporter's state; `cond` is its condition, notified when a page leaves BUSY, when the
    background mapper may have work, and at close. Each public method says whether it needs
    the lock held ("lock held"), takes it itself ("takes the lock"), or calls the driver
    without it ("off the lock").

The map transaction
    1. `begin_map(pages, what)`, lock held: the budget is checked (CapacityError, nothing
       changed); each page leaves the unmapped pages, BUSY, with a kept handle set or a
       fresh one counted in `live_sets` (a `MapJob` per page).
    2. `drive_map(jobs)`, with the lock or off it: the driver calls (create the fresh sets,
       map every layer); all pages or none: a failure undoes the driver's side and raises.
    3. `end_map(jobs, seconds)`, lock held: reported (handles created, pages mapped), MAPPED,
       the user told; or `abort_map(jobs, error)`: the books as before step 1, the error
       counted.
    `map_locked` runs the three under the lock. Jobs driven off the lock count in `busy`
    (`close()` and planners wait for them) from `begin_map(off_lock=True)`, or
    `start_off_lock`, until `end_map`, `abort_map` or `end_off_lock` (a TP rank maps a
    reserved page off the lock, reports it, and publishes it later with `end_map`).

The unmap transaction
    1. `begin_unmap(p)`, lock held: spare `p` becomes BUSY, no longer a spare, counted in
       `busy`.
    2. `drive_unmap(p)`, with the lock or off it: every layer or none (a failure maps the
       layers done back and raises).
    3. `finish_unmap(p, seconds)`, lock held: UNMAPPED, its handle set kept, or returned for
       the caller to give to `release_set`; or `abort_unmap(p, error)`: MAPPED and spare again,
       the error counted.
    `unmap_spare_locked` runs them under the lock.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from threading import Condition, RLock
from typing import Any, Protocol

from accounting.events import PoolEvent, PoolObserver
from allocator.backend import Backend
from allocator.errors import CapacityError, ClosedError
from allocator.pages import LayerSet
from allocator.reporting import Reporter
from allocator.spares import SparePolicy, TpTrim
from allocator.states import PageState
from allocator.transaction import Transaction

QUIESCE_TIMEOUT_S = 0.5  # `quiescent` waits this long at most for driver calls in flight

# Bound once: reading a member off the enum class costs a few hundred ns, and `set_use` runs
# for every page an allocation touches.
_UNMAPPED, _MAPPED, _BUSY = PageState.UNMAPPED, PageState.MAPPED, PageState.BUSY


class PageUser(Protocol):
    """The slot allocator on top of a store."""

    def pages_changed(self, pages: Iterable[int]) -> None:
        """Pages changed state (mapped, unmapped, busy); called with the store's lock held."""


class Attachment(Protocol):
    """A background mapper or a TP coordinator attached to a store: closed by `close()`."""

    def close(self) -> None: ...


class TpAttachment(Attachment, TpTrim, Protocol):
    """A TP coordinator (allocator.tp), as the store sees it: closed by `close()`, trims as
    rank 0 plans them (`trim_locked`, called by the spare policy)."""


@dataclass(eq=False)
class MapJob:
    """One page id in a map transaction: from `begin_map` to `end_map` or `abort_map`."""

    page: int
    handles: list[int] | None  # the set it is mapped with; None: a fresh one not made yet
    fresh: bool  # the set is new to the store (counted at begin, created by drive_map)
    mapped: bool = False  # drive_map mapped it
    reported: bool = False  # HANDLES_CREATED (when fresh) and PAGES_MAPPED went out
    off_lock: bool = False  # driven without the lock: counted in `busy`
    failed_op: str = ""  # the driver call that failed (create, map), for the failure log


@dataclass(frozen=True)
class StoreState:
    """Everything a test compares to prove that a failed call changed nothing (`debug_state`).

    `state`: one PageState byte per page id; `in_use`: one byte per page id, 1 while the
    user's occupants touch it; `handles`: per page id the handle set it is mapped with, or
    None; `spares`: the spare page ids, in the order they emptied; `unmapped`: the UNMAPPED
    page ids, ascending (BUSY ones are in neither); `kept`: the handle sets kept for the next
    maps (the last one is taken first); `live_sets`: handle sets alive
    (mapped, kept, or being made or released); `busy`: driver calls under way off the lock;
    `pinned`, `ahead`, `fenced`: the spare policy's pins, pages wanted ahead and fenced spares;
    `occupied`: the user's occupant count."""

    state: bytes
    in_use: bytes
    handles: tuple[tuple[int, ...] | None, ...]
    spares: tuple[int, ...]
    unmapped: tuple[int, ...]
    kept: tuple[tuple[int, ...], ...]
    live_sets: int
    busy: int
    pinned: tuple[int, ...]
    ahead: tuple[int, ...]
    fenced: tuple[int, ...]
    occupied: int


class PageStore:
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
        self.handle_pool_pages = max_spare_pages if handle_pool_pages is None else handle_pool_pages
        self.policy = SparePolicy(
            self,
            min_spare_pages=min_spare_pages,
            max_spare_pages=max_spare_pages,
            unmap_grace_s=unmap_grace_s,
            grace_pages=grace_pages,
        )
        self.reporter = Reporter(observer, name)
        self.lock = RLock()
        self.cond = Condition(self.lock)
        self._closed = False
        self.state = bytearray(num_pages)  # a PageState per page id (all UNMAPPED)
        self.in_use = bytearray(num_pages)  # 1 while the user's occupants touch the page
        self.spares: dict[int, None] = {}  # MAPPED, not in use; in the order they emptied
        self.unmapped: list[int] = list(range(num_pages))  # kept sorted
        self.live_sets = 0  # handle sets alive: mapped, kept, being made or released
        self.busy = 0  # driver calls under way off the lock (maps, unmaps, releases)
        self._handles: list[list[int] | None] = [None] * num_pages
        self._kept: list[list[int]] = []  # handle sets of unmapped pages, for the next maps
        self._user: PageUser | None = None
        self._mapper: Attachment | None = None
        self._tp: TpAttachment | None = None
        # First, so an observer that refuses (an account another pool follows) costs nothing.
        self.reporter.observer.attach(self.report_slots)
        try:
            self.pages = LayerSet(
                backend, layers=layers, reserved_bytes=num_pages * page_bytes, page_bytes=page_bytes
            )
        except BaseException:
            self.reporter.observer.detach(self.report_slots)
            raise

    # -- who drives the store ------------------------------------------------------------------
    @property
    def user(self) -> PageUser | None:
        """The slot allocator on top (`attach_user`), told of every page change."""
        return self._user

    @property
    def mapper(self) -> Attachment | None:
        """The background mapper (allocator.mapper) while one runs."""
        return self._mapper

    @property
    def tp(self) -> Any:
        """The TP coordinator (allocator.tp) while the store follows a TP group."""
        return self._tp

    def attach_user(self, user: PageUser) -> None:
        """Make `user` the store's slot allocator; a store has one (ValueError). Lock held."""
        if self._user is not None:
            raise ValueError(f"store {self.name!r} already has a user")
        self._user = user

    def detach_user(self, user: PageUser) -> None:
        """`user` no longer follows the store. Lock held."""
        if self._user is user:
            self._user = None

    def attach_mapper(self, mapper: Attachment) -> None:
        """A background mapper runs for this store from now; one at most, and none under TP
        (ValueError: its timing would decide page changes). Takes the lock."""
        with self.lock:
            if self._mapper is not None:
                raise ValueError(f"pool {self.name!r} already has a background mapper")
            if self._tp is not None:
                raise ValueError(
                    f"pool {self.name!r} follows a TP group (allocator.tp): its page changes "
                    "must happen inside alloc/free, so it takes no background mapper"
                )
            self._mapper = mapper

    def detach_mapper(self, mapper: Attachment) -> None:
        """The background mapper stopped; the store maps on the allocating thread again.
        Takes the lock."""
        with self.lock:
            if self._mapper is mapper:
                self._mapper = None

    def attach_tp(self, tp: TpAttachment) -> None:
        """The store follows a TP group through coordinator `tp` from now: no background
        mapper, trims as rank 0 plans them (ValueError if either is attached). Lock held."""
        if self._mapper is not None:
            raise ValueError(
                f"pool {self.name!r} has a background mapper, expected none: under TP its "
                "timing would decide rank 0's slot ids (see allocator.tp)"
            )
        if self._tp is not None:
            raise ValueError(f"pool {self.name!r} already follows a TP group")
        self._tp = tp

    def detach_tp(self, tp: TpAttachment) -> bool:
        """The store works alone again; False if `tp` was not attached. Lock held."""
        if self._tp is not tp:
            return False
        self._tp = None
        return True

    # -- use and spares (lock held) ------------------------------------------------------------
    def set_use(self, p: int, used: bool) -> None:
        """The user's occupants of page `p` went from none to some (True) or back (False), or
        stay as they were. Lock held."""
        self.in_use[p] = used
        if used:
            if self.spares.pop(p, 0) is None:  # it was a spare
                self.policy.spare_used(p)
        elif self.state[p] == _MAPPED:
            self.spares[p] = None

    def is_mapped(self, p: int) -> bool:
        """Whether page id `p` is in range and MAPPED."""
        return 0 <= p < self.num_pages and self.state[p] == _MAPPED

    @property
    def kept_sets(self) -> int:
        """Handle sets kept for the next maps."""
        return len(self._kept)

    # -- occupants and the observer --------------------------------------------------------------
    def report_slots(self) -> None:
        """Report the occupant figure to the observer now (its `flush`); a no-op once closed.
        Takes the lock."""
        with self.lock:
            if not self._closed:
                self.reporter.report()

    def safe_point(self) -> None:
        """Report, then let the observer do bounded work (`at_safe_point`); call it when the
        reporter's `tick` says it is due. Off the lock: call it without holding it."""
        self.reporter.restart_count()
        self.report_slots()
        self.reporter.observer.at_safe_point()

    def stats(self) -> dict[str, int]:
        """The store's figures now. Takes the lock."""
        with self.lock:
            return {
                "occupied_slots": self.reporter.occupied,
                "mapped_pages": self.state.count(_MAPPED),
                "spare_pages": len(self.spares),
                "kept_handle_sets": len(self._kept),
                "live_handle_sets": self.live_sets,
                "physical_bytes": self.live_sets * self.set_bytes,
                "busy_pages": self.busy,
                "driver_failures": self.reporter.failures.total,
                "pages_mapped_total": self.reporter.pages_mapped_total,
                "pages_unmapped_total": self.reporter.pages_unmapped_total,
            }

    def debug_state(self) -> StoreState:
        """A copy of the books (`StoreState`, field by field there), for tests. Takes the
        lock."""
        with self.lock:
            policy = self.policy
            return StoreState(
                state=bytes(self.state),
                in_use=bytes(self.in_use),
                handles=tuple(None if h is None else tuple(h) for h in self._handles),
                spares=tuple(self.spares),
                unmapped=tuple(self.unmapped),
                kept=tuple(tuple(h) for h in self._kept),
                live_sets=self.live_sets,
                busy=self.busy,
                pinned=tuple(policy.pinned),
                ahead=tuple(policy.ahead),
                fenced=tuple(policy.fences),
                occupied=self.reporter.occupied,
            )

    # -- memory ------------------------------------------------------------------------------------
    def address(self, layer: int, page: int) -> int:
        """Where page id `page` starts in layer `layer`."""
        return self.pages.address(layer, page)

    def byte_tensor(self, layer: int, size: int) -> Any:
        """A uint8 tensor over the first `size` bytes of layer `layer` (allocator.pages)."""
        return self.pages.byte_tensor(layer, size)

    # -- budget (lock held) ------------------------------------------------------------------------
    def sets_needed(self, pages: Iterable[int]) -> int:
        """New handle sets a map of `pages` creates: one for each UNMAPPED page (a BUSY one,
        reserved by a TP rank, holds its own) beyond the kept sets."""
        state = self.state
        unheld = sum(1 for p in pages if state[p] == _UNMAPPED)
        return max(0, unheld - len(self._kept))

    def check_budget(self, new_sets: int, what: str) -> None:
        """CapacityError naming `what` when `new_sets` more handle sets would go over the
        physical budget."""
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
        """Whether `new_sets` more handle sets fit the physical budget."""
        return (
            self.physical_budget is None
            or (self.live_sets + new_sets) * self.set_bytes <= self.physical_budget
        )

    # -- the map transaction -----------------------------------------------------------------------
    def map_locked(self, pages: list[int], what: str = "map pages") -> None:
        """Map every page of `pages` now, lock held throughout. All or nothing: CapacityError
        (naming `what`) over the budget, DriverError (counted) when the driver fails, and
        then nothing changed."""
        if not pages:
            return
        jobs = self.begin_map(pages, what)
        t0 = time.perf_counter()
        try:
            self.drive_map(jobs)
        except BaseException as e:
            self.abort_map(jobs, e)
            raise
        self.end_map(jobs, time.perf_counter() - t0)

    def begin_map(self, pages: Sequence[int], what: str, *, off_lock: bool = False) -> list[MapJob]:
        """Step 1, lock held: each page, which must be UNMAPPED, becomes BUSY with a kept
        handle set (the most recently kept first) or a fresh one counted in `live_sets`.
        CapacityError naming `what` over the budget, RuntimeError for a page not unmapped;
        either changes nothing. `off_lock`: the jobs will be driven without the lock (counted
        in `busy`)."""
        unmapped, state = self.unmapped, self.state
        for p in pages:
            i = bisect.bisect_left(unmapped, p)
            if i == len(unmapped) or unmapped[i] != p:
                raise RuntimeError(
                    f"{self.name}: page {p} to map is {PageState(state[p]).name}, expected UNMAPPED"
                )
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"{self.name}: pages to map {list(pages)} name a page twice")
        self.check_budget(self.sets_needed(pages), what)
        jobs: list[MapJob] = []
        for p in pages:
            del unmapped[bisect.bisect_left(unmapped, p)]
            state[p] = _BUSY
            if self._kept:
                jobs.append(MapJob(p, self._kept.pop(), fresh=False))
            else:
                self.live_sets += 1  # made by drive_map
                jobs.append(MapJob(p, None, fresh=True))
        if off_lock:
            self.start_off_lock(jobs)
        return jobs

    def drive_map(self, jobs: list[MapJob]) -> None:
        """Step 2, with the lock held or off it (the jobs are BUSY: nothing else touches
        them): make the fresh handle sets and map every layer of every job not mapped yet.
        All or nothing: a failure unmaps and releases what this call did, notes the failed
        call on its job and raises."""
        with Transaction() as t:
            for job in jobs:
                if job.mapped:
                    continue
                op = "create"
                try:
                    if job.handles is None:
                        job.handles = self.pages.create_set()
                        t.append(self._drop_created_set, job)
                    op = "map"
                    self.pages.map_page(job.page, job.handles)
                except BaseException:
                    job.failed_op = op
                    raise
                job.mapped = True
                t.append(self._unmap_driven, job)
            t.commit()

    def _drop_created_set(self, job: MapJob) -> None:
        handles, job.handles = job.handles, None
        if handles is not None:
            self.pages.release_set(handles)

    def _unmap_driven(self, job: MapJob) -> None:
        job.mapped = False
        self.pages.unmap_page(job.page)

    def start_off_lock(self, jobs: list[MapJob]) -> None:
        """Begun `jobs` are driven without the lock from now: counted in `busy`, so `close()`
        and the planners wait for them. Lock held."""
        for job in jobs:
            job.off_lock = True
        self.busy += len(jobs)

    def end_off_lock(
        self, jobs: list[MapJob], seconds: float, error: BaseException | None = None
    ) -> None:
        """`jobs` driven off the lock are back (a TP rank's pages mapped ahead, still BUSY):
        out of `busy`; those mapped are reported now (`seconds`: the drive), an `error` is
        counted. Lock held."""
        self._land(jobs)
        if isinstance(error, Exception):
            self.reporter.failed(_failed_op(jobs), error)
        self._report_mapped(jobs, seconds)
        self.cond.notify_all()

    def end_map(self, jobs: list[MapJob], seconds: float) -> None:
        """Step 3, lock held: mapped `jobs` (driven in `seconds`) are reported if they were
        not, MAPPED (spares unless in use) and the user is told."""
        for job in jobs:
            if not job.mapped:
                raise RuntimeError(f"{self.name}: page {job.page} to end its map is not mapped")
        landed = self._land(jobs)
        for job in jobs:
            self._set_mapped(job.page, job.handles)
        self._report_mapped(jobs, seconds)
        self._changed([j.page for j in jobs])
        if landed:
            self.cond.notify_all()

    def abort_map(self, jobs: list[MapJob], error: BaseException | None = None) -> None:
        """Give begun `jobs` up, lock held: pages mapped by a drive that was not ended (TP
        pages reserved ahead) are unmapped, each handle set kept (room permitting) or
        released, each page UNMAPPED again; `error` (the drive's) is counted. After a failed
        `map_locked` the books, the backend and the observer are as before it."""
        landed = self._land(jobs)
        failed = _failed_op(jobs)
        for job in reversed(jobs):
            p = job.page
            if job.mapped:
                try:
                    self.pages.unmap_page(p)  # best effort: the page is given up whatever
                except Exception as e:
                    self.reporter.failed("unmap", e)
                job.mapped = False
                if job.reported:
                    self.reporter.emit(PoolEvent.PAGES_UNMAPPED, 1)
            if job.handles is None:
                self.live_sets -= 1  # counted at begin, never made (or released by the drive)
            elif len(self._kept) < self.handle_pool_pages:
                self._kept.append(job.handles)
            else:
                self._release_now(job.handles, known=not job.fresh or job.reported)
            job.handles = None
            self.state[p] = _UNMAPPED
            bisect.insort(self.unmapped, p)
        if isinstance(error, Exception):
            self.reporter.failed(failed, error)
        if landed:
            self.cond.notify_all()

    def _land(self, jobs: list[MapJob]) -> int:
        landed = 0
        for job in jobs:
            if job.off_lock:
                job.off_lock = False
                landed += 1
        self.busy -= landed
        return landed

    def _report_mapped(self, jobs: list[MapJob], seconds: float) -> None:
        done = [j for j in jobs if j.mapped and not j.reported]
        created = sum(1 for j in done if j.fresh)
        if created:
            self.reporter.emit(PoolEvent.HANDLES_CREATED, created)
        if done:
            self.reporter.emit(PoolEvent.PAGES_MAPPED, len(done), seconds)
        for job in done:
            job.reported = True

    def _set_mapped(self, p: int, handles: list[int] | None) -> None:
        self.state[p] = _MAPPED
        self._handles[p] = handles
        if not self.in_use[p]:
            self.spares[p] = None
            self.policy.spare_mapped()

    def _changed(self, pages: Iterable[int]) -> None:
        if self._user is not None:
            self._user.pages_changed(pages)

    def _release_now(self, handles: list[int], *, known: bool) -> None:
        """Release a handle set leaving the store (lock held); `known`: the observer has it."""
        try:
            self.pages.release_set(handles)
        except Exception as e:  # the driver keeps what it could not release; counted
            self.reporter.failed("release", e)
        self.live_sets -= 1
        if known:
            self.reporter.emit(PoolEvent.HANDLES_RELEASED, 1)

    # -- the unmap transaction -------------------------------------------------------------------
    def unmap_spare_locked(self, p: int) -> bool:
        """Unmap spare page `p` now, lock held throughout; keep or release its handle set. A
        failure leaves the page whole and spare, is counted and logged: returns False."""
        self.begin_unmap(p)
        try:
            seconds = self.drive_unmap(p)
        except Exception as e:  # the page was put back whole
            self.abort_unmap(p, e)
            return False
        except BaseException:
            self.abort_unmap(p)
            raise
        handles = self.finish_unmap(p, seconds)
        if handles is not None:
            self.release_set(handles)
        return True

    def begin_unmap(self, p: int) -> None:
        """Step 1, lock held: spare `p` becomes BUSY, leaves the spares (its fence too) and
        counts in `busy`; the user is told. A fence of `p` not done yet is waited for first
        (the one rule every unmap keeps: docs/allocator.md#the-cuda-fence-rule): the spare
        policy's own trims never pick such a page, a TP follower's trim (rank 0's plan, taken
        as it comes) or a direct caller may."""
        fence = self.policy.fences.get(p)
        if fence is not None and not fence.done():
            fence.wait()
        self.state[p] = _BUSY
        self.busy += 1
        self.spares.pop(p, None)
        self.policy.forget(p)
        self._changed((p,))

    def drive_unmap(self, p: int) -> float:
        """Step 2, with the lock held or off it: unmap every layer of BUSY page `p`; returns
        the seconds it took. A failure maps the layers done back (the page stays whole) and
        raises."""
        t0 = time.perf_counter()
        self.pages.unmap_page(p, self._handles[p])
        return time.perf_counter() - t0

    def abort_unmap(self, p: int, error: BaseException | None = None) -> None:
        """Step 3 after a failed drive, lock held: `p` is MAPPED again (a spare unless in
        use), out of `busy`; the user is told, `error` counted."""
        self.state[p] = _MAPPED
        self.busy -= 1
        if not self.in_use[p]:
            self.spares[p] = None
        self._changed((p,))
        if isinstance(error, Exception):
            self.reporter.failed("unmap", error)
        self.cond.notify_all()

    def finish_unmap(self, p: int, seconds: float) -> list[int] | None:
        """Step 3, lock held: `p` is UNMAPPED (reported, `seconds` the drive) and its handle
        set kept; or, with no room to keep it, returned for the caller to give to
        `release_set` (still counted in `busy` until then)."""
        handles = self._handles[p]
        if handles is None:
            raise RuntimeError(f"{self.name}: page {p} to unmap holds no handle set")
        self._handles[p] = None
        self.state[p] = _UNMAPPED
        bisect.insort(self.unmapped, p)
        self.reporter.emit(PoolEvent.PAGES_UNMAPPED, 1, seconds)
        self.cond.notify_all()
        if len(self._kept) < self.handle_pool_pages:
            self._kept.append(handles)
            self.busy -= 1
            return None
        return handles

    def release_set(self, handles: list[int]) -> None:
        """Release a handle set `finish_unmap` returned: the driver calls run as the caller
        holds the lock or not, the books take it. Never raises for the driver (counted)."""
        try:
            self.pages.release_set(handles)
        except Exception as e:  # the driver keeps what it could not release; counted
            with self.lock:
                self.reporter.failed("release", e)
        finally:
            with self.lock:
                self.busy -= 1
                self.live_sets -= 1
                self.reporter.emit(PoolEvent.HANDLES_RELEASED, 1)
                self.cond.notify_all()

    @contextlib.contextmanager
    def quiescent(self, timeout: float = QUIESCE_TIMEOUT_S) -> Iterator[None]:
        """Hold the lock with no driver call in flight (`busy` 0), waiting up to `timeout` for
        those under way (the background mapper's maps and releases, off the lock) to end:
        the backend's memory and what the store has reported are then the same. For a
        ledger snapshot's truth (accounting.reconcile.HostMemfdTruth). Takes the lock."""
        with self.lock:
            deadline = time.monotonic() + timeout
            while self.busy and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break  # a stuck driver call: read anyway, the figure may be a page off
                self.cond.wait(left)
            yield

    # -- lifetime ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether `close()` has begun: every later call refuses (`check_open`)."""
        return self._closed

    def check_open(self, op: str) -> None:
        """ClosedError naming `op` once the store is closed."""
        if self._closed:
            raise ClosedError(f"{self.name}.{op}: the pool is closed")

    def close(self) -> None:
        """Unmap every page, release every handle set and reservation. Idempotent; completes
        whatever the driver says (failures are counted and logged, never raised).

        A background mapper or TP coordinator still attached is stopped first (off the lock:
        its thread may be waiting for it); pending fences are waited for, and then the
        device: pages still in use carry no fence, and device work queued on them (the
        engine's last kernels, a copy of their rows back into native buffers a moment ago)
        must run before they are unmapped (`Backend.synchronize`; a failure is counted and
        the unmaps go ahead: the driver has lost the context by then). Takes the lock."""
        if self._mapper is not None:
            self._mapper.close()
        if self._tp is not None:  # gives back its pages mapped ahead and detaches
            self._tp.close()
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.cond.notify_all()
            while self.busy:  # a background step is calling the driver; let it finish
                self.cond.wait(timeout=1.0)
            reporter = self.reporter
            try:
                self.policy.wait_fences()
            except Exception as e:  # counted; the drain below waits for all device work anyway
                reporter.failed("synchronize", e)
            self._drain_device()
            reporter.occupied = 0
            reporter.report()
            reporter.observer.detach(self.report_slots)
            mapped = [p for p, s in enumerate(self.state) if s == _MAPPED]
            for p in mapped:
                try:
                    self.pages.unmap_page(p)
                except Exception as e:
                    reporter.failed("unmap", e)
                self.state[p] = _UNMAPPED
            if mapped:
                reporter.emit(PoolEvent.PAGES_UNMAPPED, len(mapped))
            sets = [h for h in self._handles if h is not None] + self._kept
            self._handles = [None] * self.num_pages
            self._kept = []
            self.spares.clear()
            for handles in sets:
                try:
                    self.pages.release_set(handles)
                except Exception as e:
                    reporter.failed("release", e)
            released, self.live_sets = self.live_sets, 0
            if released:
                reporter.emit(PoolEvent.HANDLES_RELEASED, released)
            try:
                self.pages.free_reservations()
            except Exception as e:  # the backend's close frees what is left
                reporter.failed("free_reservation", e)

    def _drain_device(self) -> None:
        """Wait for all device work queued so far (close: before pages in use are unmapped)."""
        sync = getattr(self.pages.backend, "synchronize", None)
        if sync is None or not any(s == _MAPPED for s in self.state):
            return
        try:
            sync()
        except Exception as e:
            self.reporter.failed("synchronize", e)

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failed_op(jobs: list[MapJob]) -> str:
    """The driver call that failed a drive of `jobs` ("map" when none says)."""
    return next((j.failed_op for j in jobs if j.failed_op), "map")
