"""The narrowest wrapping of SGLang's SWA page allocator that tells the follower what it did.

SGLang 0.5.23's `SWATokenToKVPoolAllocator` keeps the SWA side in
`swa_attn_allocator`, a `PagedTokenToKVPoolAllocator` whose free list
(`free_pages`, a tensor of page ids) holds whole pages. Pages leave that list
only in `alloc`, `alloc_extend` and `alloc_decode`, always from its front
(after `merge_and_sort_free` when it had to fold the staged pages in), and come
back only through `_release_page_ids` (reached from `free`, `free_page_ids`,
`free_segment` and `free_group_end`, hence from `SWATokenToKVPoolAllocator.free`,
`free_swa`, `free_swa_segment` for tokens leaving the window, and deferred free
groups) or all at once in `clear`.

`AllocatorHooks` replaces exactly those six methods *on the one instance*
(instance attributes shadowing the class's; the class and every other allocator
are untouched). Each calls the original and records what it did in the journal
(`journal`): a tuple appended to a list, nothing read from the device, no lock.
The journal is replayed onto the follower (allocator.rows) in batches (`flush`):
every `batch` recorded calls, when an allocation went past the rows known to be
mapped, when the background mapper finds the journal idle for `IDLE_FLUSH_S`, and
whenever a reader asks (`Bridge.stats`, `Bridge.flush`).

Why handing out rows before the follower knows is safe (docs/allocator.md#the-journal has
the argument in full): after each replay the first rows of SGLang's free list whose pages
are mapped (at most `max_spare_pages` of them not in use) are *pinned* (`PageStore.pin`),
and their count is a budget. SGLang's list is a stack for these calls, so the journal's
`net` bounds how deep into the front last read an allocation reached. One that goes past
the budget has the next rows of that front mapped and pinned before SGLang's method returns
(`RowFollower.cover`, counted as `waited_allocs` when it had to map), reading nothing from
the device; only past all of the front read, or after a merge, does the replay wait to read
what was taken (`forced`). On CUDA, spares not pinned are fenced at each re-pin.

The rows at the front (`ahead_rows` of them, as far as their pages hold at most
`ahead_pages` pages not in use, and whatever that cap twice the widest recent allocation)
are also handed to the background mapper after each replay, so their pages are mapped
before they are needed.
Every `PACK_EVERY` releases the replay looks at whether the free list needs
packing (`_maybe_pack`).

The full-token allocator (`full_attn_allocator`) is not wrapped: in a
DeepSeek-V4 pool its ids are logical (no buffer of their own).

`remove()` deletes the instance attributes, restoring the class methods, and
replays what is left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from allocator.checks import check_count
from allocator.rows import RowFollower, packing
from kvledger.sglang.bridge.compat import WRAPPED_METHODS
from kvledger.sglang.bridge.journal import MERGE, RELEASE, TAKE, Journal
from kvledger.sglang.bridge.readback import HostReader, host_ids
from kvledger.sglang.bridge.reorder import reorder

log = logging.getLogger(__name__)

AHEAD_ROWS = 64  # rows at the front of SGLang's free list kept mapped ahead
# ... but at most this many pages not in use among them: a page mapped ahead that the
# engine never asks for (the front when a fill stops) is a map for nothing.
AHEAD_PAGES = 1
# Rows at the front read with each batch: pinned as far as mapped, and what an allocation
# past the pinned rows can be mapped from without reading the device.
FRONT_ROWS = 256
PACK_EVERY = 16  # releases between two looks at whether the free list needs packing
RECENT_REPLAYS = 32  # replays over which the widest allocation sets how far to map ahead
BATCH = 64  # recorded calls between two replays
IDLE_FLUSH_S = 0.02  # the background mapper replays a journal left alone this long


class AllocatorHooks:
    def __init__(
        self,
        allocator: Any,
        follower: RowFollower,
        *,
        reader: Any = None,
        ahead_rows: int = AHEAD_ROWS,
        ahead_pages: int = AHEAD_PAGES,
        batch: int = BATCH,
    ) -> None:
        missing = [m for m in WRAPPED_METHODS if not hasattr(allocator, m)]
        if missing:
            raise TypeError(
                f"{type(allocator).__name__} lacks {', '.join(missing)}, expected SGLang "
                "0.5.23's PagedTokenToKVPoolAllocator"
            )
        shadowed = [m for m in WRAPPED_METHODS if m in vars(allocator)]
        if shadowed:
            raise RuntimeError(
                f"{type(allocator).__name__} instance already overrides {', '.join(shadowed)}; "
                "expected an allocator no one else has wrapped"
            )
        check_count("batch", batch, 1)
        check_count("ahead_pages", ahead_pages, 0)
        self.allocator = allocator
        self.follower = follower
        self.reader = reader or HostReader()
        self.ahead_rows = ahead_rows
        self.ahead_pages = ahead_pages
        self.front_rows = max(ahead_rows, FRONT_ROWS)
        self.batch = batch
        self.installed = False
        self.resyncs = 0  # times the follower was re-read from SGLang's allocator
        self.flushes = 0  # replays
        self.forced = 0  # replays that waited to read what an allocation took (CUDA: a wait)
        self.packs = 0  # times SGLang's free list was reordered to pack
        self.journal = Journal(self.reader)
        self.safe_until = 0  # journal.net may reach this before a replay is needed
        self.soft_until = 0  # past this (3/4 of the pinned rows used) the next take replays
        self._lock = threading.Lock()  # replays (the hooks' recording takes no lock)
        self._owner: int | None = None  # the thread that drives the allocator
        self._since_pack = 0
        self._resync_due = False
        self._fp0: Any = None  # the free list an allocation takes from (after a merge)
        self._calls = 0  # hooked calls begun + ended: odd while one runs
        self._idle_calls = -1  # `_calls` at the mapper's last idle look, and since when
        self._idle_since = 0.0
        self._front: list[int] = []  # the first rows of SGLang's list at the last replay
        self._widest = 0  # the most rows one allocation took since the last replay
        self._recent: deque[int] = deque(maxlen=RECENT_REPLAYS)  # `_widest` of recent replays
        self._cover_rows = 0  # rows announced ahead whatever `ahead_pages`: see `_pin`
        self._short = False  # the last pin found mapped rows a pack would bring to the front
        orig = {m: getattr(allocator, m) for m in WRAPPED_METHODS}
        self._orig = orig
        journal = self.journal
        raw = journal.raw

        def taking(name: str) -> Callable[..., Any]:
            fn = orig[name]

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._calls += 1  # odd: inside a call (see `_flush`)
                self._fp0 = allocator.free_pages
                try:
                    return fn(*args, **kwargs)
                finally:
                    fp0 = self._fp0
                    self._fp0 = None
                    taken = fp0.shape[0] - allocator.free_pages.shape[0]
                    if taken > 0:
                        if taken > self._widest:
                            self._widest = taken
                        journal.net += taken
                        raw.append((TAKE, fp0, taken, journal.net))
                    self._calls += 1
                    if taken > 0 and (journal.net > self.soft_until or len(raw) >= self.batch):
                        self._flush(wait=False, owner=True)

            wrapper.__name__ = name
            return wrapper

        merge = orig["merge_and_sort_free"]

        def merge_and_sort_free(*args: Any, **kwargs: Any) -> Any:
            if not allocator.staged_pages:
                return merge(*args, **kwargs)
            with self._lock:
                out = merge(*args, **kwargs)
                raw.append((MERGE, journal.net))
                self.safe_until = self.soft_until = -(1 << 62)  # no row is known mapped
            if self._fp0 is not None:
                self._fp0 = allocator.free_pages  # the allocation takes from the merged list
            return out

        release = orig["_release_page_ids"]

        def release_page_ids(*page_ids: Any) -> Any:
            self._calls += 1
            try:
                out = release(*page_ids)
                if not allocator.need_sort:  # in front of the list (else staged until a merge)
                    for t in page_ids:
                        journal.net -= t.numel()
                raw.append((RELEASE, page_ids, journal.net))
            finally:
                self._calls += 1
            if len(raw) >= self.batch:
                self._flush(wait=False, owner=True)
            return out

        def clear(*args: Any, **kwargs: Any) -> Any:
            self._calls += 1
            try:
                out = orig["clear"](*args, **kwargs)
                with self._lock:
                    self._resync_locked()
            finally:
                self._calls += 1
            return out

        self._wrappers: dict[str, Callable[..., Any]] = {
            "alloc": taking("alloc"),
            "alloc_extend": taking("alloc_extend"),
            "alloc_decode": taking("alloc_decode"),
            "merge_and_sort_free": merge_and_sort_free,
            "_release_page_ids": release_page_ids,
            "clear": clear,
        }

    def install(self) -> None:
        """Shadow the six methods; call from the thread that drives the allocator."""
        if self.installed:
            return
        self._owner = threading.get_ident()
        with self._lock:
            self.journal.clear()
            self._pin(host_ids(self.allocator.free_pages[: self.front_rows]).tolist())
        for name, fn in self._wrappers.items():
            setattr(self.allocator, name, fn)
        self.installed = True

    def remove(self) -> None:
        """Restore the class's methods on the instance and replay what was recorded.
        Idempotent."""
        if not self.installed:
            return
        for name in self._wrappers:
            self.allocator.__dict__.pop(name, None)
        self.installed = False
        self._flush(wait=True, owner=True)

    def held_by_engine(self) -> list[int]:
        """Pages the allocator has handed out now: all pages minus its free (and staged) list.
        Reads the list from the device (attach, `clear`, after a divergence)."""
        a = self.allocator
        free = set(host_ids(a.get_all_free_pages()).tolist())
        return [p for p in range(1, int(a.num_pages) + 1) if p not in free]

    def flush(self, *, wait: bool = True) -> None:
        """Replay what was recorded onto the follower (`wait`: waiting for ids still being
        read). From any thread; on the one driving the allocator it may also pack and re-read
        SGLang's allocator after a divergence."""
        self._flush(wait=wait, owner=threading.get_ident() == self._owner)

    def settle(self) -> None:
        self.flush(wait=True)

    def on_owner_thread(self) -> bool:
        """Whether the caller is the thread that installed the hooks (drives the allocator)."""
        return threading.get_ident() == self._owner

    def exclusive(self) -> Any:
        """The hooks' lock: no replay runs while it is held (compaction)."""
        return self._lock

    @property
    def front(self) -> list[int]:
        """The first rows of SGLang's list as last read."""
        return self._front

    def repin(self, front: list[int]) -> None:
        """Pin `front` as SGLang's new front (after the caller changed the list, holding
        `exclusive()`, with no batch in flight: the spares get no new fence)."""
        self._pin(front, fence_spares=False)

    def pack_if_short(self) -> None:
        """Pack SGLang's free list if the last pin found it needs it (`_short`) and the journal
        is empty; holding `exclusive()` on the allocator's thread (compaction, after its
        moves re-pinned the front)."""
        if self._short and not len(self.journal):
            self._maybe_pack()

    def idle_flush(self) -> None:
        """The background mapper's call when it has nothing to do: replay a journal that SGLang
        has left alone (no hooked call) for IDLE_FLUSH_S, so pages freed by an engine gone
        quiet come back. While SGLang keeps calling, its own calls replay: a replay on this
        thread then would only compete with it for the interpreter."""
        if not len(self.journal):
            return
        now, calls = time.monotonic(), self._calls
        if calls != self._idle_calls:
            self._idle_calls, self._idle_since = calls, now
            return
        if now - self._idle_since >= IDLE_FLUSH_S:
            self._flush(wait=False, owner=False)

    # -- replay ------------------------------------------------------------------------------
    def _flush(self, *, wait: bool, owner: bool) -> None:
        with self._lock:
            journal = self.journal
            if not len(journal) and not self._resync_due:
                return
            self.flushes += 1
            if self._resync_due and owner:
                self._resync_locked()
                return
            if journal.raw:
                self._drain(owner)
            self._replay(wait)
            peak = journal.peak()
            if peak is not None and peak > self.safe_until and not self._cover(peak):
                self.forced += 1  # past the known front: read what was taken, waiting
                self._replay(True)
            if owner and not len(journal) and (self._since_pack >= PACK_EVERY or self._short):
                self._maybe_pack()

    def _drain(self, owner: bool) -> None:
        """Close the batch. The front read with it must be SGLang's list right after the
        batch's last call: on the allocator's thread it is; from another thread (the mapper's
        idle replay, a reader's `stats()`) only when no hooked call ran meanwhile, which the
        call counter tells (odd inside a call; unchanged across the reads)."""
        journal = self.journal
        if owner:
            journal.drain((self.allocator.free_pages, self.front_rows))
            return
        calls = self._calls
        n = len(journal.raw)
        free = self.allocator.free_pages
        if not calls & 1 and calls == self._calls:
            journal.drain((free, self.front_rows), count=n)

    def _replay(self, wait: bool) -> None:
        f = self.follower
        taken, given, releases, front = self.journal.replay(wait=wait, held=f.held_flags)
        try:
            if taken:
                f.take(taken)
        except BaseException:
            self._resync_due = True  # SGLang handed the rows out: re-read it next time
            raise
        if releases:
            # Taken first, then given back: a page refilled in the same batch never empties.
            # On CUDA the pages emptied wait for the device before they are unmapped (and
            # so does every spare: `_pin` fences them).
            if given:
                f.give_back(given, self.reader.fence_now(), trim=False)
            self._since_pack += releases
        if front is not None:
            self._pin(front)

    def _cover(self, peak: int) -> bool:
        """SGLang may have taken rows past the pinned ones: at most `peak - replayed_net` of
        the front last read (released rows, taken first, are held, so mapped). Map and pin
        those (on this thread: `waited_allocs` counts it), reading nothing from the device.
        False when that is more rows than the front read holds, or after a merge."""
        journal, f = self.journal, self.follower
        need = peak - journal.replayed_net
        if need > len(self._front) or journal.merged():
            return False
        store = f.store
        with store.lock:
            pages = f.cover(self._front[:need])
            store.pin([*store.pinned, *pages])
        self.safe_until = self.soft_until = journal.replayed_net + need
        return True

    def _pin(self, front: list[int], *, fence_spares: bool = True) -> None:
        """Pin the pages of the rows at the front that can be handed out without a map, set
        the budget of rows SGLang may take before the next replay, announce the front to the
        mapper and apply the spare policy (under the new pins)."""
        journal, f = self.journal, self.follower
        store = f.store
        self._front = front
        with store.lock:
            # Whatever `ahead_pages` allows, the rows of twice the widest allocation of the
            # last RECENT_REPLAYS replays that had one are announced (so the next one finds
            # its rows mapped, and the mapper has time for the one after). In a fill the
            # one page ahead already covers them; after a churn's packing the front may
            # interleave the rows of a spare with those of an unmapped page, and the spare
            # would use up `ahead_pages`.
            if self._widest:
                self._recent.append(self._widest)
                self._widest = 0
                self._cover_rows = 2 * max(self._recent)
            # What the next allocation may need (for `_short`): those rows when more than a
            # page's (the one page ahead covers narrower ones).
            reach = self._cover_rows if self._cover_rows > store.page_bytes // f.row_bytes else 0
            safe, pinned, ahead, warm = f.front(
                front, store.max_spare_pages, self.ahead_rows, self.ahead_pages, self._cover_rows
            )
            # Fewer rows mapped at the front than the next allocation may take, while more
            # free rows are mapped further down: packing would bring them to the front.
            self._short = safe < min(reach, len(front)) and packing.mapped_free_rows(f) > safe
            store.pin(pinned)
            if self.ahead_rows:
                store.set_ahead(ahead)
            if journal.merged():
                self.safe_until = self.soft_until = -(1 << 62)
            else:
                # The next replay: at 3/4 of the pinned rows, or when SGLang first takes a
                # row of a page not in use (the page mapped ahead), so that the mapper maps
                # the page after it while SGLang fills this one.
                self.safe_until = journal.replayed_net + safe
                self.soft_until = journal.replayed_net + min(safe * 3 // 4, warm)
            fence = self.reader.fence_now() if fence_spares else None
            if fence is not None:
                # Rows handed out and given back since the front was read are unknown here,
                # and GPU work may still write them: a page that is not pinned any more is
                # unmapped only after the device has drained past this point.
                store.fence([p for p in store.spares if p not in store.pinned], fence)
            if not store.closed:
                store.after_release_locked()

    def _maybe_pack(self) -> None:
        """Packing: when more page ids are mapped than the held rows need, reorder SGLang's
        free list (a permutation of the same ids: any order is valid for SGLang's paged
        allocator, which takes from the front and sorts on merge) so the next allocations
        fill the most occupied mapped pages first and the sparse ones empty. The order is
        computed where the list lives (a key per row, uploaded; a sort on the device for a
        CUDA pool), so nothing is read back."""
        self._since_pack = 0
        if not self._short and not packing.fragmented(self.follower):
            return
        a, f = self.allocator, self.follower
        keys = packing.pack_keys(f)
        a.free_pages = reorder(a.free_pages, keys)
        self.packs += 1
        if a.staged_pages:  # the list is not every free row: learn the front with a batch
            self.safe_until = self.soft_until = self.journal.net
            self._front = []
            return
        # Replayed to the end, the follower's free rows are SGLang's list: its new front is
        # known on the host, nothing read back.
        free = np.flatnonzero(np.frombuffer(f.held_flags, np.uint8) == 0)
        self._pin(free[np.argsort(keys[free], kind="stable")][: self.front_rows].tolist())

    def _resync_locked(self) -> None:
        """Make the follower SGLang's held pages as they are now, and pin its front (the
        allocator's thread: `clear`, after a failed take)."""
        self._resync_due = False
        self.resyncs += 1
        self.journal.clear()
        f = self.follower
        held = set(self.held_by_engine())
        mine = set(f.held().tolist())
        if mine - held:
            f.give_back(sorted(mine - held), self.reader.fence_now())
        if held - mine:
            f.take(sorted(held - mine))
        self._pin(host_ids(self.allocator.free_pages[: self.front_rows]).tolist())
