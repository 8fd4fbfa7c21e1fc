"""The background mapper: keeps pages mapped ahead of demand and unmaps spares behind it.

Mapping one page id costs a driver call per layer (about 1.6-2.0 ms for 43 layers on an
H200, docs/background.md#cuda-driver-facts), so it must not sit on the allocation path.
This thread runs the page store's `background_step` whenever there is work: spares below
`min_spare_pages`, pages a follower wants mapped ahead (`PageStore.set_ahead`), or spares
above `max_spare_pages` for longer than the store's unmap grace. The store calls the driver
outside its lock, so allocations that find a mapped page never wait on the driver. When a
step finds nothing to do, `on_idle` runs (the SGLang bridge replays its journal there).
"""

from __future__ import annotations

import logging
import threading
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
        if store.mapper is not None:
            raise ValueError(f"pool {store.name!r} already has a background mapper")
        if store.tp is not None:
            raise ValueError(
                f"pool {store.name!r} follows a TP group (allocator.tp): its page changes must "
                "happen inside alloc/free, so it takes no background mapper"
            )
        self.pool = pool
        self.store = store
        self.idle_seconds = idle_seconds
        self.error_backoff = error_backoff
        self.on_idle = on_idle  # called (outside the store's lock) when a step found no work
        self.errors = 0  # failed steps (each also counted by the store's failure log)
        self._stop = threading.Event()
        store.mapper = self
        self._thread = threading.Thread(
            target=self._run, name=f"kvledger-mapper-{store.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        store = self.store
        while not self._stop.is_set():
            try:
                worked = store.background_step()
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
            return store.cond.wait_for(store.idle, timeout=timeout)

    def close(self) -> None:
        """Stop the thread; idempotent. The store stays open and falls back to sync mapping."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self.store.cond:
            self.store.cond.notify_all()
        self._thread.join()
        self.store.mapper = None

    def __enter__(self) -> BackgroundMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
