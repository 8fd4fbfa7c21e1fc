"""The page store's spare policy: what to unmap when, and what to map ahead.

- Unmap behind, with hysteresis bounded in time and in count: spares beyond
  `max_spare_pages` are unmapped once they have stayed beyond it for `unmap_grace_s`
  seconds (a free, or the background mapper, finds the grace over), but at most
  `grace_pages` of them may wait out the grace: a free that leaves more unmaps the rest at
  once (on the freeing thread; fenced ones by the background mapper, which is woken). The
  most recently emptied go first. A pinned spare (`pin`) stays; a spare wanted ahead goes
  last, and not while a stale one (neither pinned nor wanted) waits for its fence; the grace
  itself unmaps stale spares only: a spare wanted ahead stays mapped past it (within
  `max_spare_pages + grace_pages`), since the take it is wanted for would have it mapped
  again (a pause longer than the grace between two wide allocations would otherwise cost a
  map and an unmap each time, the map during the next one's step); a spare
  whose fence has not signalled (the GPU work that last used it, on CUDA) is not unmapped
  at all until it has.
- Map ahead: pages a follower hands out next (`set_ahead`) while spares are fewer than
  `max_spare_pages`, or at `max_spare_pages` while one of them is stale (neither pinned nor
  wanted ahead): the wanted page takes the stale one's place, which is trimmed behind it
  (the grace, then first in line), so one spare at most goes beyond the watermark, and
  mapping ahead and trimming never undo each other (each maps or unmaps what the other
  does not want). Then enough to keep `min_spare_pages` spares, within the physical budget.
- A failed unmap leaves the page whole and spare; a free retries it no sooner than
  `retry_after_s` later (the background mapper after its error backoff).

Under TP (allocator.tp) no timing may decide a page change: trims there follow rank 0's
plan at once (the store's TP attachment), and no background mapper runs.

`SparePolicy` is given its store and keeps its own state (the options above, pins, pages
wanted ahead, fences, when the spares rose over the watermark); it changes pages only
through the store's unmap transaction. It sees the store as a `SpareStore`, the few books
and calls it reads or makes (allocator.store.PageStore is one), so this module does not
import the store: the store makes its policy, never the other way. Every method: the
store's lock held.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from threading import Condition
from typing import Protocol

from allocator.checks import check_count
from allocator.states import PageState

RETRY_AFTER_FAILURE_S = 1.0  # a failed unmap is retried by a release no sooner than this


class Fence(Protocol):
    """GPU work that used a page (a CUDA event recorded at give-back); host: always done."""

    def done(self) -> bool: ...
    def wait(self) -> None: ...


class TpTrim(Protocol):
    """A store's TP coordinator (allocator.tp), as the policy sees it."""

    def trim_locked(self) -> None:
        """Unmap the spares over `max_spare_pages` that rank 0 names (lock held)."""


class SpareStore(Protocol):
    """What the policy reads and calls of its store (allocator.store.PageStore, where each
    member is described): the books it reads, the store's condition, who drives the store,
    the budget, and the unmap transaction, its one way to change a page."""

    state: bytearray  # a PageState per page id
    spares: dict[int, None]  # MAPPED, not in use; in the order they emptied
    unmapped: list[int]  # sorted
    busy: int  # driver calls under way off the lock
    cond: Condition  # notified when the background mapper may have work

    @property
    def tp(self) -> TpTrim | None: ...
    @property
    def mapper(self) -> object | None: ...
    @property
    def kept_sets(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def budget_allows(self, new_sets: int = 1) -> bool: ...
    def unmap_spare_locked(self, p: int) -> bool: ...


class SparePolicy:
    """The spare policy of `store` (see the module docstring); the store makes its own."""

    def __init__(
        self,
        store: SpareStore,
        *,
        min_spare_pages: int,
        max_spare_pages: int,
        unmap_grace_s: float,
        grace_pages: int,
    ) -> None:
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
        self.store = store
        self.min_spare_pages = min_spare_pages
        self.max_spare_pages = max_spare_pages
        self.unmap_grace_s = float(unmap_grace_s)
        self.grace_pages = grace_pages
        self.retry_after_s = RETRY_AFTER_FAILURE_S
        self.ahead: dict[int, None] = {}  # pages a follower hands out next: map them ahead
        # Pages an engine may hand out before its follower hears of it: never unmapped.
        self.pinned: dict[int, None] = {}
        self.fences: dict[int, Fence] = {}  # spare page -> the GPU work that last used it
        self._over_since: float | None = None  # when spares last rose above max_spare_pages
        self._retry_at = 0.0  # no trim by a release before this (after a failed unmap)

    # -- what followers tell it ------------------------------------------------------------
    def set_ahead(self, pages: Iterable[int]) -> None:
        """The pages a follower will hand out next; the mapper keeps them mapped. Replaces
        the previous ones."""
        self.ahead = dict.fromkeys(pages)
        state = self.store.state
        if self.ahead_room() and any(state[p] == PageState.UNMAPPED for p in self.ahead):
            self.store.cond.notify_all()  # the mapper has work (waking it costs the GIL)

    def pin(self, pages: Iterable[int]) -> None:
        """Pages that must stay mapped whether in use or not: a follower that learns of
        allocations late (kvledger.engines.sglang.bridge.journal) pins the pages of the rows the
        engine may hand out meanwhile. Replaces the previous pins."""
        self.pinned = dict.fromkeys(pages)

    def fence(self, pages: Iterable[int], fence: Fence) -> None:
        """Spare `pages` may not be unmapped before `fence` is done (pages not spare are
        skipped: a page in use needs none, and gets a new one when it empties)."""
        spares = self.store.spares
        for p in pages:
            if p in spares:
                self.fences[p] = fence

    # -- what the store tells it -----------------------------------------------------------
    def spare_used(self, p: int) -> None:
        """Spare `p` went into use: its fence is moot; back within the watermark, the grace
        starts over."""
        self.fences.pop(p, None)
        if len(self.store.spares) <= self.max_spare_pages:
            self._over_since = None

    def spare_mapped(self) -> None:
        """A map added a spare: over the watermark (a map the mapper began while under it,
        releases coming meanwhile), the grace starts now, as at a release."""
        if len(self.store.spares) > self.max_spare_pages and self._over_since is None:
            self._over_since = time.monotonic()

    def forget(self, p: int) -> None:
        """Spare `p` leaves the spares to be unmapped: its fence goes with it."""
        self.fences.pop(p, None)

    def wait_fences(self) -> None:
        """Wait for every pending fence and forget them (close)."""
        for f in list(self.fences.values()):
            f.wait()
        self.fences.clear()

    # -- unmapping behind --------------------------------------------------------------------
    def after_release_locked(self) -> None:
        """Apply the policy after occupants left (from a free or a give-back)."""
        store = self.store
        n = len(store.spares)
        if n <= self.max_spare_pages:
            self._over_since = None
            return
        if store.tp is not None:  # under TP a function of the operation sequence: no timing
            store.tp.trim_locked()
            return
        cap = self.grace_cap
        if n > cap and time.monotonic() >= self._retry_at:
            self.trim_locked(keep=cap)  # beyond what the grace may keep: now
            if len(store.spares) > cap and store.mapper is not None:
                store.cond.notify_all()  # fenced ones: the mapper waits for them
            if len(store.spares) <= self.max_spare_pages:
                return
        now = time.monotonic()
        if self._over_since is None:
            self._over_since = now
        if now - self._over_since < self.unmap_grace_s or now < self._retry_at:
            return  # a later release, or the mapper's next look, finds the grace over
        if store.mapper is not None:
            store.cond.notify_all()  # only now: waking it costs the freeing thread the GIL
        else:
            self.trim_locked(wanted=False)  # the grace's trim: stale spares only

    def trim_locked(self, keep: int | None = None, *, wanted: bool = True) -> None:
        """Unmap spares beyond `keep` (default max_spare_pages) now, on this thread, the most
        recently emptied first; fenced and pinned spares stay, and so do spares wanted ahead
        unless `wanted`. A failed unmap stops it (the next release retries after
        `retry_after_s`)."""
        store = self.store
        keep = self.max_spare_pages if keep is None else keep
        while len(store.spares) > keep:
            p = self.trim_candidate(wanted=wanted)
            if p is None:
                return
            if not store.unmap_spare_locked(p):
                self._retry_at = time.monotonic() + self.retry_after_s
                return
        if len(store.spares) <= self.max_spare_pages:
            self._over_since = None

    def trim_candidate(self, *, wanted: bool | None = None) -> int | None:
        """The spare to unmap next: pinned pages stay, fenced pages wait, pages wanted ahead
        go last, and not at all while a stale spare (neither pinned nor wanted) waits for its
        fence: that one goes when the fence signals. Trimming the wanted page instead would
        have the mapper map it again at once in the stale one's place, in a loop for as long
        as the fence takes (docs/allocator.md#map-ahead). `wanted`: whether a page wanted
        ahead may go at all; by default only beyond what the grace may keep
        (`max_spare_pages + grace_pages`): within it the grace trims stale spares only."""
        if wanted is None:
            wanted = self.over_grace_cap()
        later = None
        stale_fenced = False
        for p in reversed(self.store.spares):
            if p in self.pinned:
                continue
            f = self.fences.get(p)
            if f is not None and not f.done():
                stale_fenced = stale_fenced or self.stale(p)
                continue
            if self.stale(p):
                return p
            if wanted and later is None:
                later = p
        return None if stale_fenced else later

    def stale(self, p: int) -> bool:
        """A spare neither pinned nor wanted ahead: the first to trim, and one whose place a
        page wanted ahead may take."""
        return p not in self.pinned and p not in self.ahead

    @property
    def grace_cap(self) -> int:
        """The most spares the grace may keep: `max_spare_pages + grace_pages`."""
        return self.max_spare_pages + self.grace_pages

    def over_grace_cap(self) -> bool:
        """More spares than the grace may keep: the surplus goes at once, pages wanted ahead
        included (last)."""
        return len(self.store.spares) > self.grace_cap

    def trim_due(self) -> bool:
        """Spares beyond what the grace may keep, or beyond the watermark past the grace."""
        return self.over_grace_cap() or (
            len(self.store.spares) > self.max_spare_pages and self._grace_over()
        )

    def _grace_over(self) -> bool:
        since = self._over_since
        return since is not None and time.monotonic() - since >= self.unmap_grace_s

    def pending_fence(self) -> Fence | None:
        """The fence, not done yet, of a spare the trim would take once it is (the mapper
        waits for it), or None. A spare the grace keeps (pinned, or wanted ahead within
        `max_spare_pages + grace_pages`) is no work: its fence is not waited for. Waiting for
        it anyway made the mapper look busy for as long as the fence was not asked about; a
        device-wide fence (`done()` true only once someone waited) then was never done, and
        `wait_idle` ran to its timeout after every round of the bench's round trip on CUDA."""
        over_cap = self.over_grace_cap()
        for p in reversed(self.store.spares):
            if p in self.pinned:
                continue
            f = self.fences.get(p)
            if f is not None and not f.done() and (over_cap or self.stale(p)):
                return f
        return None

    # -- mapping ahead -------------------------------------------------------------------------
    def ahead_room(self) -> bool:
        """Whether a page wanted ahead may be mapped now: spares below the watermark, or at
        it with one of them stale, whose place the wanted page takes (mapped now, the stale
        one trimmed behind it)."""
        spares = self.store.spares
        n = len(spares)
        if n != self.max_spare_pages:
            return n < self.max_spare_pages
        return any(self.stale(p) for p in spares)

    def map_target(self) -> int | None:
        """The page the background mapper should map next, or None: the first page wanted
        ahead that is unmapped (while `ahead_room`), else the lowest unmapped page while
        spares are below `min_spare_pages`; none when no handle set can be had within the
        budget."""
        store = self.store
        if not store.unmapped or (not store.kept_sets and not store.budget_allows(1)):
            return None
        if self.ahead_room():
            state, unmapped = store.state, PageState.UNMAPPED
            for p in self.ahead:
                if state[p] == unmapped:
                    return p
        if len(store.spares) < self.min_spare_pages:
            return store.unmapped[0]
        return None

    def background_idle(self) -> bool:
        """Nothing for the background mapper to do now."""
        store = self.store
        if store.closed:
            return True
        if store.busy:
            return False
        if self.map_target() is not None:
            return False
        return len(store.spares) <= self.max_spare_pages or (
            self.trim_candidate() is None and self.pending_fence() is None
        )
