"""The background mapper: keeps pages mapped ahead of demand and unmaps spares behind it.

Mapping one page id costs a driver call per layer (about 1.6-2.0 ms for 43 layers on an
H200, docs/background.md#cuda-driver-facts), so it must not sit on the allocation path.
This thread does the page store's driver work whenever its spare policy
(allocator.spares) has some: spares below `min_spare_pages`, pages a follower wants mapped
ahead (`set_ahead`), or spares above `max_spare_pages` for longer than the unmap grace.
Each step picks one page under the store's lock, begins its map or unmap transaction
(allocator.store), calls the driver with the lock released, and ends the transaction under
it again, so allocations that find a mapped page never wait on the driver. When the only
spares to unmap are fenced, the step waits for a fence (a device synchronisation, on this
thread only). When a step finds nothing to do, `on_idle` runs (the SGLang bridge replays
its journal there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from allocator.store import PageStore

log = logging.getLogger(__name__)


def store_of(owner: Any) -> PageStore:
    """The page store of a slot allocator (anything with a `.store`) or the store itself."""
    store = getattr(owner, "store", owner)
    if not isinstance(store, PageStore):
        raise TypeError(f"{type(owner).__name__}: expected a PageStore or an allocator over one")
    return store


class BackgroundMapper:
    def __init__(
        self,
        pool: Any,
        *,
        idle_seconds: float = 0.05,
        error_backoff: float = 1.0,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        store = store_of(pool)
        self.pool = pool
        self.store = store
        self.idle_seconds = idle_seconds
        self.error_backoff = error_backoff
        self.on_idle = on_idle  # called (off the store's lock) when a step found no work
        self.errors = 0  # failed steps (each also counted by the store's failure log)
        self._stop = threading.Event()
        store.attach_mapper(self)  # refused when the store has one, or follows a TP group
        self._thread = threading.Thread(
            target=self._run, name=f"kvledger-mapper-{store.name}", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the mapper's thread is alive."""
        return self._thread.is_alive()

    def step(self) -> bool:
        """Map one page ahead or unmap one spare behind, the driver called off the lock; when
        the only spares to unmap are fenced, wait for a fence. False when there was nothing
        to do. Raises what the driver raised (counted by the store), the books restored."""
        store, policy = self.store, self.store.policy
        jobs = None
        spare = fence = None
        with store.lock:
            if store.closed:
                return False
            page = policy.map_target()
            if page is not None:
                jobs = store.begin_map([page], f"map page {page} ahead", off_lock=True)
            elif policy.trim_due():
                spare = policy.trim_candidate()
                if spare is not None:
                    store.begin_unmap(spare)
                else:
                    fence = policy.pending_fence()
                    if fence is None:
                        return False
            else:
                return False
        if jobs is not None:
            self._map(jobs)
        elif spare is not None:
            self._unmap(spare)
        elif fence is not None:
            fence.wait()  # the fenced spares may go at the next step
            with store.cond:
                store.cond.notify_all()  # what `wait_idle` waits on may have changed
        return True

    def _map(self, jobs: list[Any]) -> None:
        store = self.store
        t0 = time.perf_counter()
        try:
            store.drive_map(jobs)
        except BaseException as e:
            with store.lock:
                store.abort_map(jobs, e)
            raise
        with store.lock:
            store.end_map(jobs, time.perf_counter() - t0)

    def _unmap(self, p: int) -> None:
        store = self.store
        try:
            seconds = store.drive_unmap(p)
        except BaseException as e:  # the page was put back whole
            with store.lock:
                store.abort_unmap(p, e)
            raise
        with store.lock:
            handles = store.finish_unmap(p, seconds)
        if handles is not None:
            store.release_set(handles)  # the driver off the lock

    def _run(self) -> None:
        store = self.store
        while not self._stop.is_set():
            try:
                worked = self.step()
            except Exception:  # counted and logged (rate-limited) by the store
                self.errors += 1
                self._stop.wait(self.error_backoff)
                continue
            if not worked:
                if self.on_idle is not None:
                    try:
                        self.on_idle()
                    except Exception:
                        self.errors += 1
                        log.exception("kvledger mapper %s: on_idle failed", store.name)
                with store.cond:
                    if not self._stop.is_set():
                        store.cond.wait(timeout=self.idle_seconds)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until there is nothing left to do (for tests and benchmarks)."""
        store = self.store
        with store.cond:
            return store.cond.wait_for(store.policy.background_idle, timeout=timeout)

    def close(self) -> None:
        """Stop the thread; idempotent. The store stays open and maps on the allocating
        thread again."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self.store.cond:
            self.store.cond.notify_all()
        self._thread.join()
        self.store.detach_mapper(self)

    def __enter__(self) -> BackgroundMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
