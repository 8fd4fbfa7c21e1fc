"""The background mapper: keeps spare pages mapped ahead of demand and unmaps them behind it.

Mapping one page id costs a driver call per layer (about 1.6 ms for 43 layers on
an H200, DESIGN.md), so it must not sit on the allocation path. This thread runs
`SwaPool.background_step` whenever the pool's spare pages leave the
`[min_spare_pages, max_spare_pages]` band; the pool calls the driver outside its
lock, so allocations that find a spare page never wait on the driver.
"""

from __future__ import annotations

import logging
import threading

from allocator.pool import SwaPool

log = logging.getLogger(__name__)


class BackgroundMapper:
    def __init__(
        self, pool: SwaPool, *, idle_seconds: float = 0.05, error_backoff: float = 1.0
    ) -> None:
        if pool._mapper is not None:
            raise ValueError(f"pool {pool.name!r} already has a background mapper")
        if pool._tp is not None:
            raise ValueError(
                f"pool {pool.name!r} follows a TP group (allocator.tp): its page changes must "
                "happen inside alloc/free, so it takes no background mapper"
            )
        self.pool = pool
        self.idle_seconds = idle_seconds
        self.error_backoff = error_backoff
        self.errors = 0
        self._stop = threading.Event()
        pool._mapper = self
        self._thread = threading.Thread(
            target=self._run, name=f"kvledger-mapper-{pool.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        pool = self.pool
        while not self._stop.is_set():
            try:
                worked = pool.background_step()
            except Exception:
                self.errors += 1
                log.exception("background mapper of pool %r: a step failed; retrying", pool.name)
                self._stop.wait(self.error_backoff)
                continue
            if not worked:
                with pool._cond:
                    if not self._stop.is_set():
                        pool._cond.wait(timeout=self.idle_seconds)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the watermarks are met (for tests and benchmarks)."""
        pool = self.pool
        with pool._cond:
            return pool._cond.wait_for(
                lambda: (
                    pool.closed
                    or (
                        pool._busy == 0
                        and len(pool._empty) <= pool.max_spare_pages
                        and (
                            len(pool._empty) >= pool.min_spare_pages
                            or not pool._unmapped
                            # no handle set to reuse and no budget for a fresh one
                            or (not pool._spare_sets and not pool._budget_allows_one())
                        )
                    )
                ),
                timeout=timeout,
            )

    def close(self) -> None:
        """Stop the thread; idempotent. The pool stays open and falls back to sync mapping."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self.pool._cond:
            self.pool._cond.notify_all()
        self._thread.join()
        self.pool._mapper = None

    def __enter__(self) -> BackgroundMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
