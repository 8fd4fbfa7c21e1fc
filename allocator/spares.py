"""The page store's spare policy: what to unmap when, and what to map ahead.

- Unmap behind, with hysteresis bounded in time and in count: spares beyond
  `max_spare_pages` are unmapped once they have stayed beyond it for `unmap_grace_s`
  seconds (a free, or the background mapper, finds the grace over), but at most
  `grace_pages` of them may wait out the grace: a free that leaves more unmaps the rest at
  once (on the freeing thread; fenced ones by the background mapper, which is woken). The
  most recently emptied go first. A pinned spare (`PageStore.pin`) stays; a spare wanted
  ahead goes last, and not while a stale one (neither pinned nor wanted) waits for its
  fence; a spare whose fence has not signalled (the GPU work that last used it, on CUDA) is
  not unmapped at all until it has.
- Map ahead: pages a follower hands out next (`set_ahead`) while spares are fewer than
  `max_spare_pages`, or at `max_spare_pages` while one of them is stale (neither pinned nor
  wanted ahead): the wanted page takes the stale one's place, which is trimmed behind it
  (the grace, then first in line), so one spare at most goes beyond the watermark, and
  mapping ahead and trimming never undo each other (each maps or unmaps what the other
  does not want). Then enough to keep `min_spare_pages` spares, within the physical budget.
- A failed unmap leaves the page whole and spare; a free retries it no sooner than
  `retry_after_s` later (the background mapper after its error backoff).

Under TP (allocator.tp) no timing may decide a page change: trims there follow rank 0's
plan at once, and no background mapper runs.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING, Any

from accounting.events import PoolEvent

if TYPE_CHECKING:
    from allocator.pages import LayerSet

_UNMAPPED, _BUSY = 0, 2  # allocator.store's states


class SparePolicy:
    """Mixed into allocator.store.PageStore; the attributes below are the store's."""

    if TYPE_CHECKING:
        tp: Any
        mapper: Any
        cond: threading.Condition
        lock: threading.RLock
        closed: bool
        state: bytearray
        unmapped: list[int]
        kept: list[list[int]]
        spares: dict[int, None]
        fences: dict[int, Any]
        ahead: dict[int, None]
        pinned: dict[int, None]
        tp_reserve: dict[int, Any]
        live_sets: int
        busy: int
        min_spare_pages: int
        max_spare_pages: int
        grace_pages: int
        unmap_grace_s: float
        retry_after_s: float
        handles: list[list[int] | None]
        pages: LayerSet
        _over_since: float | None
        _retry_at: float

        def tp_trim_locked(self) -> None: ...
        def unmap_spare_locked(self, p: int) -> bool: ...
        def budget_allows(self, new_sets: int = 1) -> bool: ...
        def begin_unmap(self, p: int) -> None: ...
        def abort_unmap(self, p: int) -> None: ...
        def finish_unmap(self, p: int, seconds: float) -> list[int] | None: ...
        def released_set(self) -> None: ...
        def set_mapped(self, p: int, handles: list[int]) -> None: ...
        def _put_back_set(self, handles: list[int], fresh: bool) -> None: ...
        def _changed(self, pages: Any) -> None: ...
        def _failed(self, op: str, error: BaseException) -> None: ...
        def emit(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None: ...

    def after_release_locked(self) -> None:
        """Apply the spare policy after occupants left (under the lock, from a free)."""
        n = len(self.spares)
        if n <= self.max_spare_pages:
            self._over_since = None
            return
        if self.tp is not None:  # under TP a function of the operation sequence: no timing
            self.tp_trim_locked()
            return
        cap = self.max_spare_pages + self.grace_pages
        if n > cap and time.monotonic() >= self._retry_at:
            self.trim_locked(keep=cap)  # beyond what the grace may keep: now
            if len(self.spares) > cap and self.mapper is not None:
                self.cond.notify_all()  # fenced ones: the mapper waits for them
            if len(self.spares) <= self.max_spare_pages:
                return
        now = time.monotonic()
        if self._over_since is None:
            self._over_since = now
        if now - self._over_since < self.unmap_grace_s or now < self._retry_at:
            return  # a later release, or the mapper's next look, finds the grace over
        if self.mapper is not None:
            self.cond.notify_all()  # only now: waking it costs the freeing thread the GIL
        else:
            self.trim_locked()

    def trim_locked(self, keep: int | None = None) -> None:
        """Unmap spares beyond `keep` (default max_spare_pages) now (sync), the most recently
        emptied first; fenced spares stay."""
        keep = self.max_spare_pages if keep is None else keep
        while len(self.spares) > keep:
            p = self.trim_candidate()
            if p is None:
                return
            if not self.unmap_spare_locked(p):
                self._retry_at = time.monotonic() + self.retry_after_s
                return
        if len(self.spares) <= self.max_spare_pages:
            self._over_since = None

    def trim_candidate(self) -> int | None:
        """The spare to unmap next: pinned pages stay, fenced pages wait, pages wanted ahead
        go last, and not at all while a stale spare (neither pinned nor wanted) waits for its
        fence: that one goes when the fence signals. Trimming the wanted page instead would
        have the mapper map it again at once in the stale one's place, in a loop for as long
        as the fence takes (thousands of pairs in 0.2 s on the host, see
        tests/allocator/test_rows.py)."""
        later = None
        stale_fenced = False
        for p in reversed(self.spares):
            if p in self.pinned:
                continue
            f = self.fences.get(p)
            if f is not None and not f.done():
                stale_fenced = stale_fenced or self.stale(p)
                continue
            if self.stale(p):
                return p
            later = p if later is None else later
        return None if stale_fenced else later

    def stale(self, p: int) -> bool:
        """A spare neither pinned nor wanted ahead: the first to trim, and one whose place a
        page wanted ahead may take."""
        return p not in self.pinned and p not in self.ahead

    def ahead_room(self) -> bool:
        """Whether a page wanted ahead may be mapped now: spares below the watermark, or at
        it with one of them stale, whose place the wanted page takes (mapped now, the stale
        one trimmed behind it)."""
        n = len(self.spares)
        if n != self.max_spare_pages:
            return n < self.max_spare_pages
        return any(self.stale(p) for p in self.spares)

    def _trim_due(self) -> bool:
        """Spares beyond what the grace may keep, or beyond the watermark past the grace."""
        n = len(self.spares)
        return n > self.max_spare_pages + self.grace_pages or (
            n > self.max_spare_pages and self._grace_over()
        )

    def _grace_over(self) -> bool:
        since = self._over_since
        return since is not None and time.monotonic() - since >= self.unmap_grace_s

    # -- background work (allocator.mapper runs it off the allocation path) -----------------------
    def background_step(self) -> bool:
        """Map one page ahead or unmap one spare behind, driver calls outside the lock; when
        the only spares to unmap are fenced, wait for a fence (a device synchronisation, on
        this thread only). Returns False when there is nothing to do."""
        fence = None
        with self.lock:
            if self.closed:
                return False
            p, q = self._map_target(), None
            if p is not None:
                i = bisect.bisect_left(self.unmapped, p)
                del self.unmapped[i]
                self.state[p] = _BUSY
                self.busy += 1
                fresh = not self.kept
                handles = None if fresh else self.kept.pop()
                if fresh:
                    self.live_sets += 1
            elif self._trim_due():
                q = self.trim_candidate()
                if q is not None:
                    self.begin_unmap(q)
                else:
                    fence = self._pending_fence()
                    if fence is None:
                        return False
            else:
                return False
        if p is not None:
            self._background_map(p, handles)
        elif q is not None:
            self._background_unmap(q)
        elif fence is not None:
            fence.wait()  # the fenced spares may go at the next step
        return True

    def _map_target(self) -> int | None:
        if not self.unmapped or (not self.kept and not self.budget_allows(1)):
            return None
        if self.ahead_room():
            for p in self.ahead:
                if self.state[p] == _UNMAPPED and p not in self.tp_reserve:
                    return p
        if len(self.spares) < self.min_spare_pages:
            return self.unmapped[0]
        return None

    def _background_map(self, p: int, handles: list[int] | None) -> None:
        fresh = handles is None
        t0 = time.perf_counter()
        try:
            if handles is None:
                handles = self.pages.create_set()
            self.pages.map_page(p, handles)
        except BaseException as e:
            with self.lock:
                if handles is not None:
                    self._put_back_set(handles, fresh)
                elif fresh:
                    self.live_sets -= 1
                self.state[p] = _UNMAPPED
                self.busy -= 1
                bisect.insort(self.unmapped, p)
                if isinstance(e, Exception):
                    self._failed("map", e)
                self.cond.notify_all()
            raise
        seconds = time.perf_counter() - t0
        with self.lock:
            if fresh:
                self.emit(PoolEvent.HANDLES_CREATED, 1)
            self.busy -= 1
            self.set_mapped(p, handles)
            self.emit(PoolEvent.PAGES_MAPPED, 1, seconds)
            self._changed((p,))
            self.cond.notify_all()

    def _background_unmap(self, p: int) -> None:
        t0 = time.perf_counter()
        try:
            self.pages.unmap_page(p, self.handles[p])
        except BaseException as e:  # unmap_page put the page back whole
            with self.lock:
                self.abort_unmap(p)
                if isinstance(e, Exception):
                    self._failed("unmap", e)
            raise
        seconds = time.perf_counter() - t0
        with self.lock:
            handles = self.finish_unmap(p, seconds)
        if handles is not None:
            try:
                self.pages.release_set(handles)
            except Exception as e:
                with self.lock:
                    self._failed("release", e)
            finally:
                with self.lock:
                    self.released_set()

    def _pending_fence(self) -> Any:
        """A fence of a spare not done yet (the mapper waits for it), or None."""
        for p in reversed(self.spares):
            f = self.fences.get(p)
            if f is not None and not f.done() and p not in self.pinned:
                return f
        return None

    def idle(self) -> bool:
        """Nothing for the background mapper to do now (call under the lock)."""
        if self.closed:
            return True
        if self.busy:
            return False
        if self._map_target() is not None:
            return False
        return len(self.spares) <= self.max_spare_pages or (
            self.trim_candidate() is None and self._pending_fence() is None
        )
