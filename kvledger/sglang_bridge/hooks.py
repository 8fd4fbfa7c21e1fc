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

Why handing out rows before the follower knows is safe: after each replay the
first rows of SGLang's free list whose pages are mapped (with at most
`max_spare_pages` pages not in use among them) are *pinned* (`PageStore.pin`:
never unmapped) and their count is the budget of rows SGLang may hand out before
the next replay. Releases only push rows the follower still counts as held (so
mapped) in front of them, so any allocation within the budget lands on mapped
pages. An allocation past the budget replays at once, waiting for the ids it
needs, and maps what is missing before SGLang's method returns (counted as
`waited_allocs` by the follower when it had to map). A merge re-sorts the list:
after it no row is within the budget.

The rows at the front (`ahead_rows` of them) are also handed to the background
mapper after each replay, so their pages are mapped before they are needed.
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
from collections.abc import Callable
from typing import Any

import numpy as np

from allocator.rows import RowFollower
from kvledger.sglang_bridge.compat import WRAPPED_METHODS
from kvledger.sglang_bridge.freelist import FreeListMirror, host_ids
from kvledger.sglang_bridge.journal import MERGE, RELEASE, TAKE, Divergence, Journal
from kvledger.sglang_bridge.readback import HostReader

log = logging.getLogger(__name__)

AHEAD_ROWS = 64  # rows at the front of SGLang's free list kept mapped ahead
FRONT_ROWS = 64  # rows at the front looked at for pinning, with or without map-ahead
PACK_EVERY = 16  # releases between two looks at whether the free list needs packing
BATCH = 32  # recorded calls between two replays
IDLE_FLUSH_S = 0.02  # the background mapper replays a journal left alone this long


class AllocatorHooks:
    def __init__(
        self,
        allocator: Any,
        follower: RowFollower,
        *,
        reader: Any = None,
        ahead_rows: int = AHEAD_ROWS,
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
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r}, expected an int >= 1")
        self.allocator = allocator
        self.follower = follower
        self.reader = reader or HostReader()
        self.ahead_rows = ahead_rows
        self.batch = batch
        self.installed = False
        self.resyncs = 0  # times the mirror disagreed with SGLang's list and was re-read
        self.flushes = 0  # replays
        self.forced = 0  # replays forced by an allocation past the pinned rows
        self.packs = 0  # times SGLang's free list was reordered to pack
        self.mirror = FreeListMirror(np.zeros(0, np.int64))
        self.journal = Journal(self.mirror, self.reader)
        self.safe_until = 0  # journal.taken may reach this before a replay is needed
        self._lock = threading.Lock()  # replays (the hooks' recording takes no lock)
        self._owner: int | None = None  # the thread that drives the allocator
        self._since_pack = 0
        self._last_flush = time.monotonic()
        self._resync_due = False
        self._n0 = -1  # free-list length when an allocation started (after a merge)
        orig = {m: getattr(allocator, m) for m in WRAPPED_METHODS}
        self._orig = orig
        journal = self.journal
        raw = journal.raw

        def taking(name: str) -> Callable[..., Any]:
            fn = orig[name]

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._n0 = allocator.free_pages.shape[0]  # shape: a third of len()'s cost
                try:
                    return fn(*args, **kwargs)
                finally:
                    after = allocator.free_pages.shape[0]
                    taken = self._n0 - after
                    self._n0 = -1
                    if taken > 0:
                        raw.append((TAKE, taken, after))
                        journal.taken += taken
                        if journal.taken > self.safe_until:
                            self.forced += 1
                            self._flush(wait=True, owner=True)
                        elif len(raw) >= self.batch:
                            self._flush(wait=False, owner=True)

            wrapper.__name__ = name
            return wrapper

        merge = orig["merge_and_sort_free"]

        def merge_and_sort_free(*args: Any, **kwargs: Any) -> Any:
            if not allocator.staged_pages:
                return merge(*args, **kwargs)
            with self._lock:
                out = merge(*args, **kwargs)
                raw.append((MERGE, journal.taken))
                self.safe_until = journal.taken  # the order changed: no row is known mapped
            if self._n0 >= 0:
                self._n0 = allocator.free_pages.shape[0]
            return out

        release = orig["_release_page_ids"]

        def release_page_ids(*page_ids: Any) -> Any:
            out = release(*page_ids)
            raw.append((RELEASE, page_ids, bool(allocator.need_sort)))
            if len(raw) >= self.batch:
                self._flush(wait=False, owner=True)
            return out

        def clear(*args: Any, **kwargs: Any) -> Any:
            out = orig["clear"](*args, **kwargs)
            with self._lock:
                self._resync_locked()
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
            self._read_list()
            self._after_replay(owner=True)
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
        Reads the list from the device (attach only)."""
        a = self.allocator
        free = set(host_ids(a.get_all_free_pages()).tolist())
        return [p for p in range(1, int(a.num_pages) + 1) if p not in free]

    def flush(self, *, wait: bool = True) -> None:
        """Replay what was recorded onto the follower (`wait`: waiting for released ids still
        being read). From any thread; on the one driving the allocator it may also pack and
        re-read SGLang's list after a divergence."""
        self._flush(wait=wait, owner=threading.get_ident() == self._owner)

    def settle(self) -> None:
        self.flush(wait=True)

    def idle_flush(self) -> None:
        """The background mapper's call when it has nothing to do: replay a journal left
        alone for IDLE_FLUSH_S, so pages freed by an engine gone quiet come back."""
        if len(self.journal) and time.monotonic() - self._last_flush >= IDLE_FLUSH_S:
            self._flush(wait=False, owner=False)

    # -- replay ------------------------------------------------------------------------------
    def _flush(self, *, wait: bool, owner: bool) -> None:
        with self._lock:
            if not len(self.journal) and not self._resync_due:
                return
            self.flushes += 1
            self._last_flush = time.monotonic()
            if self._resync_due and owner:
                self._resync_locked()
                return
            journal = self.journal
            journal.drain()
            try:
                taken, given, releases = journal.replay(wait=wait)
            except Divergence as e:
                self._diverged(str(e), owner)
                return
            self._apply(taken, given, releases)
            if journal.taken > self.safe_until and not wait:  # the budget ran out meanwhile
                self.forced += 1
                journal.drain()
                try:
                    taken, given, releases = journal.replay(wait=True)
                except Divergence as e:
                    self._diverged(str(e), owner)
                    return
                self._apply(taken, given, releases)
            self._after_replay(owner=owner and not len(journal))

    def _apply(self, taken: np.ndarray, given: np.ndarray, releases: int) -> None:
        """The netted rows onto the follower: takes first (a page refilled in the same batch
        never empties), then give-backs, fenced on CUDA; the spare policy runs after the new
        pins (`_after_replay`)."""
        f = self.follower
        try:
            if taken.size:
                f.take(taken)
        except BaseException:
            self._resync_due = True  # SGLang handed the rows out; re-read it next time
            raise
        if not releases:
            return
        fence = self.reader.fence_now()
        if given.size:
            f.give_back(given, fence, trim=False)
        if fence is not None:  # rows taken and released within the batch: their pages too
            store = f.store
            with store.lock:
                store.fence(list(store.spares), fence)
        self._since_pack += releases

    def _after_replay(self, *, owner: bool) -> None:
        """Pack (when due, on the allocator's thread, with nothing left to replay), then pin
        the rows at the front that are mapped, announce the front to the mapper, and apply
        the spare policy."""
        if owner and self._since_pack >= PACK_EVERY:
            self._maybe_pack()
        journal, f = self.journal, self.follower
        store = f.store
        front = self.mirror.front(max(self.ahead_rows, FRONT_ROWS)).tolist()
        with store.lock:
            safe = f.mapped_prefix(front, store.max_spare_pages)
            store.pin(f.pages_in_order(front[:safe]))
            if self.ahead_rows:
                store.set_ahead(f.pages_in_order(front[: self.ahead_rows]))
            until = journal.replayed_taken + safe
            merged_at = journal.pending_merge()
            self.safe_until = until if merged_at is None else min(until, merged_at)
            if not store.closed:
                store.after_release_locked()

    def _maybe_pack(self) -> None:
        """Packing: when more page ids are mapped than the held rows need, reorder SGLang's
        free list (a permutation of the same ids: any order is valid for SGLang's paged
        allocator, which takes from the front and sorts on merge) so the next allocations
        fill the most occupied mapped pages first and the sparse ones empty. The new order is
        written as a new tensor (CUDA: a pinned, non-blocking copy), never read back."""
        self._since_pack = 0
        if not self.follower.fragmented():
            return
        free = self.mirror.known()
        if len(free) != len(self.allocator.free_pages):
            return
        order = self.follower.pack_order(free)
        old = self.allocator.free_pages
        self.allocator.free_pages = torch_from(order, like=old)
        self.mirror.replace(order)
        self.packs += 1

    def _read_list(self) -> None:
        a = self.allocator
        staged = [host_ids(t) for t in getattr(a, "staged_pages", [])]
        self.mirror.reset(host_ids(a.free_pages), staged)
        self.journal.clear()

    def _diverged(self, what: str, owner: bool) -> None:
        self.resyncs += 1
        self.follower.divergences += 1
        log.warning(
            "kvledger sglang bridge: %s; re-reading SGLang's free list and held pages", what
        )
        if owner:
            self._resync_locked()
        else:
            self._resync_due = True
            self.safe_until = -1  # the next allocation replays on the allocator's thread

    def _resync_locked(self) -> None:
        """Make the follower and the mirror SGLang's list and held pages as they are now
        (the allocator's thread: start, `clear`, after a divergence)."""
        self._resync_due = False
        self.journal.clear()
        f = self.follower
        held = set(self.held_by_engine())
        mine = set(f.held().tolist())
        f.give_back(sorted(mine - held), self.reader.fence_now())
        f.take(sorted(held - mine))
        self._read_list()
        self._after_replay(owner=True)


def torch_from(ids: np.ndarray, *, like: Any) -> Any:
    """`ids` as a tensor of `like`'s dtype on `like`'s device, without a synchronisation."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(like.dtype)
    if like.device.type == "cpu":
        return t
    return t.pin_memory().to(like.device, non_blocking=True)
