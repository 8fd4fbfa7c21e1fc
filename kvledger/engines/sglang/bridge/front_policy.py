"""The replay-and-front policy: the journal replayed onto the follower, the front of SGLang's
free list kept mapped.

`AllocatorHooks` (allocator_hooks) records what SGLang's SWA page allocator did in the
journal and asks `FrontPolicy.flush` for a replay: every `batch` recorded calls, and when an
allocation went past the rows known to be mapped (`soft_until`). The background mapper asks
when the journal has been idle for `IDLE_FLUSH_S` (`idle_flush`), readers whenever they like
(`Bridge.stats`, `Bridge.flush`).

Why handing out rows before the follower knows is safe (docs/allocator.md#the-journal has
the argument in full): after each replay the first rows of SGLang's free list whose pages
are mapped (at most `max_spare_pages` of them not in use) are *pinned* (`pin`, through
`store.policy.pin`), and their count is the *budget*: `safe_until`, the journal's `net`
SGLang may reach before rows it takes could lie on pages not pinned, and `soft_until`, past
which the next allocation replays (3/4 of the pinned rows, or the first row of a page not
in use).
SGLang's list is a stack for these calls, so the journal's `net` bounds how deep into the
front last read an allocation reached. One that goes past the budget has the next rows of
that front mapped and pinned before SGLang's method returns (`RowFollower.cover`, counted as
`waited_allocs` when it had to map), reading nothing from the device; only past all of the
front read, or after a merge, does the replay wait to read what was taken (`forced`). On
CUDA, spares not pinned are fenced at each re-pin. The budget is set in one place,
`set_budget`, which records why (`budget_reason`, in `debug_state()`).

The rows at the front (`ahead_rows` of them, as far as their pages hold at most
`ahead_pages` pages not in use, and whatever that cap twice the widest recent allocation)
are also handed to the background mapper after each replay, so their pages are mapped
before they are needed. Every `PACK_EVERY` releases the replay looks at whether the free
list needs packing (`_maybe_pack`).

`clear` (SGLang resets its list) and a take the follower refused make the policy re-read
SGLang's allocator (`resync`), on the allocator's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from allocator.checks import check_count
from allocator.rows import RowFollower, packing
from kvledger.engines.sglang.bridge.journal import Journal
from kvledger.engines.sglang.bridge.readback import HostReader, host_ids
from kvledger.engines.sglang.bridge.reorder import reorder

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
IDLE_FLUSH_S = 0.02  # the background mapper replays a journal left alone this long
NO_ROWS = -(1 << 62)  # a budget under any `net`: no row of SGLang's list is known mapped


class FrontPolicy:
    """Replays `journal` (recorded by `AllocatorHooks` on `allocator`, SGLang's
    PagedTokenToKVPoolAllocator) onto `follower` and keeps the front of the allocator's free
    list pinned, covered, announced ahead and packed. `reader` reads the ids SGLang computed
    (readback: `HostReader` for CPU tensors, `CudaReader` for CUDA ones)."""

    # The budget, set by `set_budget` only: journal.net may reach `safe_until` before a
    # replay is needed; past `soft_until` the next allocation replays.
    safe_until: int
    soft_until: int
    budget_reason: str

    def __init__(
        self,
        allocator: Any,
        follower: RowFollower,
        *,
        reader: Any = None,
        ahead_rows: int = AHEAD_ROWS,
        ahead_pages: int = AHEAD_PAGES,
    ) -> None:
        check_count("ahead_pages", ahead_pages, 0)
        self.allocator = allocator
        self.follower = follower
        self.reader = reader or HostReader()
        self.journal = Journal(self.reader)
        self.ahead_rows = ahead_rows
        self.ahead_pages = ahead_pages
        self.front_rows = max(ahead_rows, FRONT_ROWS)
        self.lock = threading.Lock()  # replays (recording takes no lock)
        self.resyncs = 0  # times the follower was re-read from SGLang's allocator
        self.flushes = 0  # replays
        self.forced = 0  # replays that waited to read what an allocation took (CUDA: a wait)
        self.packs = 0  # times SGLang's free list was reordered to pack
        self.set_budget(0, 0, "not started")
        self._owner: int | None = None  # the thread that drives the allocator
        self._front: list[int] = []  # the first rows of SGLang's list at the last pin
        self._since_pack = 0  # releases replayed since the last look at packing
        self._resync_due = False  # a take failed: re-read SGLang on its thread
        self._short = False  # the last pin found mapped rows a pack would bring to the front
        self._recent: deque[int] = deque(maxlen=RECENT_REPLAYS)  # widest allocations
        self._cover_rows = 0  # rows announced ahead whatever `ahead_pages`: see `pin`
        self._idle_calls = -1  # journal.calls at the mapper's last idle look, and since when
        self._idle_since = 0.0

    # -- the budget ---------------------------------------------------------------------------
    def set_budget(self, safe_until: int, soft_until: int, why: str) -> None:
        """The one place the budget changes (under `lock`, or before the hooks are installed):
        SGLang may take rows until the journal's `net` reaches `safe_until`; past `soft_until`
        its next allocation replays. `why` is kept as `budget_reason`."""
        self.safe_until = safe_until
        self.soft_until = soft_until
        self.budget_reason = why

    # -- start and views ---------------------------------------------------------------------
    def start(self) -> None:
        """Take the calling thread as the allocator's, forget anything recorded and pin the
        front of SGLang's list as it is now (read from the device: attach only)."""
        self._owner = threading.get_ident()
        with self.lock:
            self.journal.clear()
            self.pin(self._read_front())

    def on_owner_thread(self) -> bool:
        """Whether the caller is the thread that started the policy (drives the allocator)."""
        return threading.get_ident() == self._owner

    def exclusive(self) -> Any:
        """The policy's lock: no replay runs while it is held (compaction)."""
        return self.lock

    @property
    def front(self) -> list[int]:
        """The first rows of SGLang's list as last pinned."""
        return self._front

    def held_by_engine(self) -> list[int]:
        """Pages the allocator has handed out now: all pages minus its free (and staged) list.
        Reads the list from the device (attach, `clear`, after a divergence)."""
        a = self.allocator
        free = set(host_ids(a.get_all_free_pages()).tolist())
        return [p for p in range(1, int(a.num_pages) + 1) if p not in free]

    def debug_state(self) -> dict[str, Any]:
        """The policy's internals, for tests and debugging (no replay, no device read): the
        budget and why it was set, the journal's `net` and the replayed one, recorded calls
        not yet drained, batches in flight, the front last pinned, the rows announced ahead
        whatever `ahead_pages`, whether the last pin asked for packing, whether a resync is
        due and the hooked calls counted so far (odd while one runs)."""
        j = self.journal
        return {
            "safe_until": self.safe_until,
            "soft_until": self.soft_until,
            "budget_reason": self.budget_reason,
            "net": j.net,
            "replayed_net": j.replayed_net,
            "recorded": len(j.raw),
            "batches_in_flight": len(j) - len(j.raw),
            "front": list(self._front),
            "cover_rows": self._cover_rows,
            "short": self._short,
            "resync_due": self._resync_due,
            "calls": j.calls,
        }

    # -- replays ------------------------------------------------------------------------------
    def flush(self, *, wait: bool = True, owner: bool | None = None) -> None:
        """Replay what was recorded onto the follower (`wait`: waiting for ids still being
        read). From any thread; on the one driving the allocator (`owner`, by default whether
        the caller is that thread) it may also pack and re-read SGLang's allocator after a
        divergence."""
        if owner is None:
            owner = self.on_owner_thread()
        with self.lock:
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

    def settle(self) -> None:
        """Replay everything, waiting for the reads in flight."""
        self.flush(wait=True)

    def idle_flush(self) -> None:
        """The background mapper's call when it has nothing to do: replay a journal that SGLang
        has left alone (no hooked call) for IDLE_FLUSH_S, so pages freed by an engine gone
        quiet come back. While SGLang keeps calling, its own calls replay: a replay on this
        thread then would only compete with it for the interpreter."""
        if not len(self.journal):
            return
        now, calls = time.monotonic(), self.journal.calls
        if calls != self._idle_calls:
            self._idle_calls, self._idle_since = calls, now
            return
        if now - self._idle_since >= IDLE_FLUSH_S:
            self.flush(wait=False, owner=False)

    def _drain(self, owner: bool) -> None:
        """Close the batch. The front read with it must be SGLang's list right after the
        batch's last call: on the allocator's thread it is; from another thread (the mapper's
        idle replay, a reader's `stats()`) only when no hooked call ran meanwhile, which the
        call counter tells (odd inside a call; unchanged across the reads)."""
        journal = self.journal
        if owner:
            journal.drain((self.allocator.free_pages, self.front_rows))
            return
        calls = journal.calls
        n = len(journal.raw)
        free = self.allocator.free_pages
        if not calls & 1 and calls == journal.calls:
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
            # so does every spare: `pin` fences them).
            if given:
                f.give_back(given, self.reader.fence_now(), trim=False)
            self._since_pack += releases
        if front is not None:
            self.pin(front)

    # -- the front ----------------------------------------------------------------------------
    def _cover(self, peak: int) -> bool:
        """SGLang may have taken rows past the pinned ones: at most `peak - replayed_net` of
        the front last read (released rows, taken first, are held, so mapped). Map and pin
        those (on this thread: `waited_allocs` counts it), reading nothing from the device.
        False when that is more rows than the front read holds, or after a merge. Under
        `lock`."""
        journal, f = self.journal, self.follower
        need = peak - journal.replayed_net
        if need > len(self._front) or journal.merged():
            return False
        store = f.store
        with store.lock:
            pages = f.cover(self._front[:need])
            store.policy.pin([*store.policy.pinned, *pages])
        until = journal.replayed_net + need
        self.set_budget(until, until, "cover: the rows taken past the pins mapped and pinned")
        return True

    def pin(self, front: list[int], *, fence_spares: bool = True) -> None:
        """Pin the pages of the rows at the front that can be handed out without a map, set
        the budget of rows SGLang may take before the next replay, announce the front to the
        mapper and apply the spare policy (under the new pins). Under `lock`; compaction,
        which changed the list with no batch in flight, passes `fence_spares=False` (the
        spares get no new fence)."""
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
            if journal.widest:
                self._recent.append(journal.widest)
                journal.widest = 0
                self._cover_rows = 2 * max(self._recent)
            # What the next allocation may need (for `_short`): those rows when more than a
            # page's (the one page ahead covers narrower ones).
            reach = self._cover_rows if self._cover_rows > store.page_bytes // f.row_bytes else 0
            safe, pinned, ahead, warm = f.front(
                front,
                store.policy.max_spare_pages,
                self.ahead_rows,
                self.ahead_pages,
                self._cover_rows,
            )
            # Fewer rows mapped at the front than the next allocation may take, while more
            # free rows are mapped further down: packing would bring them to the front.
            self._short = safe < min(reach, len(front)) and packing.mapped_free_rows(f) > safe
            store.policy.pin(pinned)
            if self.ahead_rows:
                store.policy.set_ahead(ahead)
            if journal.merged():
                self.set_budget(NO_ROWS, NO_ROWS, "pin: a merge not replayed yet")
            else:
                # The next replay: at 3/4 of the pinned rows, or when SGLang first takes a
                # row of a page not in use (the page mapped ahead), so that the mapper maps
                # the page after it while SGLang fills this one.
                base = journal.replayed_net
                self.set_budget(
                    base + safe, base + min(safe * 3 // 4, warm), "pin: the mapped front"
                )
            fence = self.reader.fence_now() if fence_spares else None
            if fence is not None:
                # Rows handed out and given back since the front was read are unknown here,
                # and GPU work may still write them: a page that is not pinned any more is
                # unmapped only after the device has drained past this point.
                store.policy.fence([p for p in store.spares if p not in store.policy.pinned], fence)
            if not store.closed:
                store.policy.after_release_locked()

    def pack_if_short(self) -> None:
        """Pack SGLang's free list if the last pin found it needs it and the journal is empty;
        holding `exclusive()` on the allocator's thread (compaction, after its moves re-pinned
        the front)."""
        if self._short and not len(self.journal):
            self._maybe_pack()

    def _maybe_pack(self) -> None:
        """Packing: when more page ids are mapped than the held rows need, reorder SGLang's
        free list (a permutation of the same ids: any order is valid for SGLang's paged
        allocator, which takes from the front and sorts on merge) so the next allocations
        fill the most occupied mapped pages first and the sparse ones empty. The order is
        computed where the list lives (a key per row, uploaded; a sort on the device for a
        CUDA pool), so nothing is read back. Under `lock`, on the allocator's thread, with
        the journal replayed to the end."""
        self._since_pack = 0
        if not self._short and not packing.fragmented(self.follower):
            return
        a, f = self.allocator, self.follower
        keys = packing.pack_keys(f)
        a.free_pages = reorder(a.free_pages, keys)
        self.packs += 1
        if a.staged_pages:  # the list is not every free row: learn the front with a batch
            net = self.journal.net
            self.set_budget(net, net, "pack: staged pages, the new front unknown until a batch")
            self._front = []
            return
        # Replayed to the end, the follower's free rows are SGLang's list: its new front is
        # known on the host, nothing read back.
        free = np.flatnonzero(np.frombuffer(f.held_flags, np.uint8) == 0)
        self.pin(free[np.argsort(keys[free], kind="stable")][: self.front_rows].tolist())

    # -- resync -------------------------------------------------------------------------------
    def resync(self) -> None:
        """Make the follower SGLang's held pages as they are now, and pin its front (the
        allocator's thread: after SGLang's `clear`)."""
        with self.lock:
            self._resync_locked()

    def _resync_locked(self) -> None:
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
        self.pin(self._read_front())

    def _read_front(self) -> list[int]:
        """The first `front_rows` rows of SGLang's list, read from the device."""
        return host_ids(self.allocator.free_pages[: self.front_rows]).tolist()
