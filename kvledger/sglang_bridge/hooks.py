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
are untouched), each calling the original and then reporting to a host mirror of
the free list (`freelist`) and the follower (allocator.rows):

- `alloc*`: how many pages left the list is host metadata (its length before and
  after), and which they are is the mirror's front: nothing is read from the
  device, and a call that takes no page (most decode steps) costs two `len`s;
- `merge_and_sort_free`: the mirror merges and sorts the same way;
- `_release_page_ids`: the ids are read back (`readback`: a view on CPU, a
  pinned non-blocking copy and an event on CUDA) and given back to the follower
  once known, the event fencing their pages against unmapping;
- `clear`: every page is free again.

After each allocation the hooks tell the follower the rows at the front of the
list (`ahead_rows` of them, whenever half were consumed or the list was merged):
the background mapper maps their pages before SGLang hands them out.

The full-token allocator (`full_attn_allocator`) is not wrapped: in a
DeepSeek-V4 pool its ids are logical (no buffer of their own).

`remove()` deletes the instance attributes, restoring the class methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from allocator.rows import RowFollower
from kvledger.sglang_bridge.compat import WRAPPED_METHODS
from kvledger.sglang_bridge.freelist import FreeListMirror, host_ids
from kvledger.sglang_bridge.readback import HostReader, PendingIds

log = logging.getLogger(__name__)

AHEAD_ROWS = 64  # rows at the front of SGLang's free list kept mapped ahead
PACK_EVERY = 16  # releases between two looks at whether the free list needs packing


class AllocatorHooks:
    def __init__(
        self,
        allocator: Any,
        follower: RowFollower,
        *,
        reader: Any = None,
        ahead_rows: int = AHEAD_ROWS,
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
        self.allocator = allocator
        self.follower = follower
        self.reader = reader or HostReader()
        self.ahead_rows = ahead_rows
        self.installed = False
        self.resyncs = 0  # times the mirror disagreed with SGLang's list and was re-read
        self.mirror = FreeListMirror(np.zeros(0, np.int64))
        self._pending: list[PendingIds] = []  # released ids not given back yet (CUDA)
        self._since_ahead = 0
        self._since_pack = 0
        self.packs = 0  # times SGLang's free list was reordered to pack
        orig = {m: getattr(allocator, m) for m in WRAPPED_METHODS}
        self._orig = orig
        self._n0 = -1  # free-list length when an allocation started (after a merge)

        def taking(name: str) -> Callable[..., Any]:
            fn = orig[name]

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._n0 = allocator.free_pages.shape[0]  # shape: a third of len()'s cost
                try:
                    return fn(*args, **kwargs)
                finally:
                    taken = self._n0 - allocator.free_pages.shape[0]
                    self._n0 = -1
                    if taken > 0:
                        self._took(taken)

            wrapper.__name__ = name
            return wrapper

        def merge_and_sort_free(*args: Any, **kwargs: Any) -> Any:
            out = orig["merge_and_sort_free"](*args, **kwargs)
            self.mirror.merge_and_sort()
            if self._n0 >= 0:
                self._n0 = allocator.free_pages.shape[0]
            self._announce()
            return out

        release = orig["_release_page_ids"]

        host = isinstance(self.reader, HostReader)

        def release_page_ids(*page_ids: Any) -> Any:
            out = release(*page_ids)
            if host:  # the ids are host memory: mirror and give back at once, no fence
                ready = [ids.reshape(-1).numpy() for ids in page_ids if ids.numel()]
                if ready:
                    self.mirror.release(ready, staged=bool(allocator.need_sort))
                    for ids in ready:
                        self.follower.give_back(ids)
                    self._since_pack += 1
                    if self._since_pack >= PACK_EVERY:
                        self._maybe_pack()
                return out
            chunks = [self.reader.read(ids) for ids in page_ids if ids.numel()]
            if chunks:
                self.mirror.release(chunks, staged=bool(allocator.need_sort))
                self._pending.extend(chunks)
                self._settle(wait=False)
                self._since_pack += 1
                if self._since_pack >= PACK_EVERY:
                    self._maybe_pack()
            return out

        def clear(*args: Any, **kwargs: Any) -> Any:
            out = orig["clear"](*args, **kwargs)
            self._settle(wait=True)
            self.follower.give_back_all()
            self._resync()
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
        if self.installed:
            return
        self._resync()
        for name, fn in self._wrappers.items():
            setattr(self.allocator, name, fn)
        self.installed = True
        self._announce()

    def remove(self) -> None:
        """Restore the class's methods on the instance. Idempotent."""
        if not self.installed:
            return
        for name in self._wrappers:
            self.allocator.__dict__.pop(name, None)
        self.installed = False
        self._settle(wait=True)

    def held_by_engine(self) -> list[int]:
        """Pages the allocator has handed out now: all pages minus its free (and staged) list.
        Reads the list from the device (attach only)."""
        a = self.allocator
        free = set(host_ids(a.get_all_free_pages()).tolist())
        return [p for p in range(1, int(a.num_pages) + 1) if p not in free]

    def settle(self) -> None:
        """Give back every freed page whose ids are still being read (waits for the reads)."""
        self._settle(wait=True)

    # -- reports ----------------------------------------------------------------------
    def _took(self, taken: int) -> None:
        if self._pending:
            self._settle(wait=True)  # the front is likely what was just released
        if len(self.mirror) - taken != self.allocator.free_pages.shape[0]:
            self._diverged(f"an allocation took {taken} pages")
            return
        self.follower.take(self.mirror.take(taken))
        self._since_ahead += taken
        if self._since_ahead * 2 >= self.ahead_rows:
            self._announce()

    def _settle(self, *, wait: bool) -> None:
        """Give back the released ids whose values are known (all of them when `wait`)."""
        pending = self._pending
        while pending and (wait or pending[0].ready()):
            p = pending.pop(0)
            self.follower.give_back(p.ids(), self.reader.fence(p))

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
        if free is None or len(free) != len(self.allocator.free_pages):
            return
        order = self.follower.pack_order(free)
        old = self.allocator.free_pages
        t = torch_from(order, like=old)
        self.allocator.free_pages = t
        self.mirror.replace(order)
        self.packs += 1
        self._announce()

    def _announce(self) -> None:
        self._since_ahead = 0
        if self.ahead_rows:
            self.follower.ahead(self.mirror.front(self.ahead_rows))

    def _resync(self) -> None:
        a = self.allocator
        staged = [host_ids(t) for t in getattr(a, "staged_pages", [])]
        self.mirror.reset(host_ids(a.free_pages), staged)

    def _diverged(self, what: str) -> None:
        self.resyncs += 1
        self.follower.divergences += 1
        log.warning(
            "kvledger sglang bridge: %s but the mirror of SGLang's free list disagrees "
            "(%d mirrored, %d in SGLang's); re-reading the list and the held pages",
            what,
            len(self.mirror),
            len(self.allocator.free_pages),
        )
        self._settle(wait=True)
        held = set(self.held_by_engine())
        mine = set(self.follower.held().tolist())
        self.follower.give_back(sorted(mine - held))
        self.follower.take(sorted(held - mine))
        self._resync()


def torch_from(ids: np.ndarray, *, like: Any) -> Any:
    """`ids` as a tensor of `like`'s dtype on `like`'s device, without a synchronisation."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(like.dtype)
    if like.device.type == "cpu":
        return t
    return t.pin_memory().to(like.device, non_blocking=True)
