"""The narrowest wrapping of SGLang's SWA page allocator that tells the follower what it did.

SGLang 0.5.23's `SWATokenToKVPoolAllocator` keeps the SWA side in
`swa_attn_allocator`, a `PagedTokenToKVPoolAllocator` whose free list
(`free_pages`, a tensor of page ids) holds whole pages. Pages leave that list
only in `alloc`, `alloc_extend` and `alloc_decode`, always from its front
(`free_pages = free_pages[n:]`, after `merge_and_sort_free` when it had to fold
the staged pages in), and come back only through `_release_page_ids` (reached
from `free`, `free_page_ids`, `free_segment` and `free_group_end`, hence from
`SWATokenToKVPoolAllocator.free`, `free_swa`, `free_swa_segment` for tokens
leaving the window, and deferred free groups) or all at once in `clear`.

`AllocatorHooks` replaces exactly those six methods *on the one instance*
(instance attributes shadowing the class's; the class and every other
allocator are untouched), each calling the original and then reporting:

- `alloc*`: the front of the free list as it stood before the call (or after
  the merge inside it) down to where the list starts now: the pages taken.
  The count is host metadata (`len`), so a call that takes no page (most
  decode steps) reads nothing back from the device;
- `merge_and_sort_free`: records the merged list the slice is taken from;
- `_release_page_ids`: the page ids passed in are the pages returned;
- `clear`: every page is free again.

The full-token allocator (`full_attn_allocator`) is not wrapped: in a
DeepSeek-V4 pool its ids are logical (no buffer of their own; C4/C128 rows are
addressed as `full_id // ratio` in SGLang's own pools).

`remove()` deletes the instance attributes, restoring the class methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.sglang_bridge.compat import WRAPPED_METHODS
from kvledger.sglang_bridge.follow import PageFollower


def _page_list(t: Any) -> list[int]:
    out = t.tolist() if hasattr(t, "tolist") else list(t)
    return out if isinstance(out, list) else [out]


class AllocatorHooks:
    def __init__(
        self,
        allocator: Any,
        follower: PageFollower,
        *,
        before_give_back: Callable[[], None] | None = None,
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
        self._before_give_back = before_give_back
        self.installed = False
        orig = {m: getattr(allocator, m) for m in WRAPPED_METHODS}
        self._orig = orig
        self._front: Any = None  # the free list pages are being taken from

        def taking(name: str) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._front = allocator.free_pages
                try:
                    return orig[name](*args, **kwargs)
                finally:
                    front, self._front = self._front, None
                    self._took(front, allocator.free_pages)

            wrapper.__name__ = name
            return wrapper

        def merge_and_sort_free(*args: Any, **kwargs: Any) -> Any:
            out = orig["merge_and_sort_free"](*args, **kwargs)
            if self._front is not None:
                self._front = allocator.free_pages
            return out

        def release_page_ids(*page_ids: Any) -> Any:
            out = orig["_release_page_ids"](*page_ids)
            pages = [p for ids in page_ids for p in _page_list(ids)]
            if pages:
                self._give_back(pages)
            return out

        def clear(*args: Any, **kwargs: Any) -> Any:
            out = orig["clear"](*args, **kwargs)
            if self.follower.held_pages:
                self._give_back_all()
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
        for name, fn in self._wrappers.items():
            setattr(self.allocator, name, fn)
        self.installed = True

    def remove(self) -> None:
        """Restore the class's methods on the instance. Idempotent."""
        if not self.installed:
            return
        for name in self._wrappers:
            self.allocator.__dict__.pop(name, None)
        self.installed = False

    def held_by_engine(self) -> list[int]:
        """Pages the allocator has handed out now: all pages minus its free (and staged) list."""
        a = self.allocator
        free = set(_page_list(a.get_all_free_pages()))
        return [p for p in range(1, int(a.num_pages) + 1) if p not in free]

    # -- reports ----------------------------------------------------------------------
    def _took(self, front: Any, now: Any) -> None:
        taken = len(front) - len(now)
        if taken > 0:
            self.follower.take(_page_list(front[:taken]))

    def _give_back(self, pages: list[int]) -> None:
        if self._before_give_back is not None:
            self._before_give_back()
        self.follower.give_back(pages)

    def _give_back_all(self) -> None:
        if self._before_give_back is not None:
            self._before_give_back()
        self.follower.give_back_all()
