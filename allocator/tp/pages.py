"""The page store's side of tensor-parallel page agreement (allocator.tp.coordinator has the
protocol).

Under TP the store runs no background mapper: every change of the allocatable pages happens
inside an alloc or a free, where it is a function of the operation sequence. `TpPages` is
given the store by the rank's coordinator and reads and changes it only through the store's
public books and its map and unmap transactions (allocator.store):

- what every rank compares at an exchange (`state`) and what a peer checks rank 0's page
  lists against (`page_state`); the spares a trim unmaps, in order (`trim_plan`);
- pages mapped ahead (TpCoordinator(ahead_pages=k)): rank 0 announces reserved pages at an
  exchange; every rank begins their map transaction at the same point of the operation
  sequence (`reserve_locked`: out of the unmapped pages, BUSY, a handle set counted, so every
  decision stays a function of the sequence), its coordinator's thread drives them off the
  lock (`next_job_locked`, `map_ahead`), and a later exchange publishes them (`publish_locked`:
  MAPPED, allocatable), mapping here any the thread has not; `drop_locked` gives them back.

Every method but `map_ahead`: the store's lock held.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from allocator.states import PageState

if TYPE_CHECKING:
    from allocator.store import MapJob, PageStore


class TpPages:
    def __init__(self, store: PageStore) -> None:
        self.store = store
        # Pages announced ahead, in their map transaction (begun, maybe driven and reported,
        # not ended: not allocatable yet).
        self.reserved: dict[int, MapJob] = {}

    # -- what ranks compare ----------------------------------------------------------------
    def state(self) -> dict[str, int]:
        """The figures every rank compares at an exchange."""
        store = self.store
        return {
            "occupied_slots": store.reporter.occupied,
            "mapped_pages": store.state.count(PageState.MAPPED),
            "spare_pages": len(store.spares),
            "live_handle_sets": store.live_sets,
            "reserved_pages": len(self.reserved),
        }

    def page_state(self, page: int) -> str:
        """'unmapped', 'reserved' (announced ahead), 'spare' (mapped, not in use), 'used' or
        'busy'."""
        store = self.store
        if page in self.reserved:
            return "reserved"
        if store.state[page] == PageState.BUSY:
            return "busy"
        if store.state[page] == PageState.UNMAPPED:
            return "unmapped"
        return "spare" if page in store.spares else "used"

    def trim_plan(self, excess: int) -> list[int]:
        """The spare pages a trim unmaps to drop `excess` of them, in order (the most recently
        emptied first)."""
        return list(reversed(self.store.spares))[:excess]

    # -- pages mapped ahead ----------------------------------------------------------------
    def reserve_locked(self, pages: list[int]) -> None:
        """Begin the map of `pages` (every one UNMAPPED, else RuntimeError and nothing
        changed): reserved until published."""
        store = self.store
        for job in store.begin_map(pages, f"reserve {len(pages)} page ids ahead"):
            self.reserved[job.page] = job
        store.cond.notify_all()

    def next_job_locked(self) -> MapJob | None:
        """The lowest reserved page nobody maps yet, now driven off the lock (counted busy
        until `map_ahead` returns); None when there is none."""
        for p in sorted(self.reserved):
            job = self.reserved[p]
            if not job.mapped and not job.off_lock:
                self.store.start_off_lock([job])
                return job
        return None

    def map_ahead(self, job: MapJob) -> None:
        """Map reserved `job` (from `next_job_locked`), the driver called off the lock, and
        report it; a failure is counted and raised, the page stays reserved."""
        store = self.store
        t0 = time.perf_counter()
        try:
            store.drive_map([job])
        except BaseException as e:
            with store.lock:
                store.end_off_lock([job], 0.0, e)
            raise
        with store.lock:
            store.end_off_lock([job], time.perf_counter() - t0)

    def idle(self) -> bool:
        """Every reserved page mapped and reported: none still being driven off the lock
        (a drive sets `mapped` before `end_off_lock` counts it and clears `busy`)."""
        return all(job.mapped and not job.off_lock for job in self.reserved.values())

    def publish_locked(self, pages: list[int]) -> None:
        """Make reserved `pages` allocatable, in order; map here any not mapped yet (raises
        what the driver raised, counted; the page stays reserved)."""
        store = self.store
        for p in pages:
            job = self.reserved[p]
            while job.off_lock:  # the coordinator's thread is mapping it
                store.cond.wait(timeout=1.0)
            t0 = time.perf_counter()
            if not job.mapped:
                try:
                    store.drive_map([job])
                except Exception as e:
                    store.reporter.failed(job.failed_op, e)
                    raise
            del self.reserved[p]
            store.end_map([job], time.perf_counter() - t0)

    def drop_locked(self) -> None:
        """Give every reserved page back (detach, close): unmapped, its handle set kept or
        released. Completes whatever the driver says (failures counted)."""
        store = self.store
        while any(job.off_lock for job in self.reserved.values()):
            store.cond.wait(timeout=1.0)
        # Highest first: abort_map gives them back in reverse, lowest first.
        jobs = [self.reserved[p] for p in sorted(self.reserved, reverse=True)]
        self.reserved.clear()
        store.abort_map(jobs)
        store.cond.notify_all()
