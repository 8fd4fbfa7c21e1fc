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

`AllocatorHooks` replaces exactly those six methods (`compat.WRAPPED_METHODS`) *on the one
instance* (instance attributes shadowing the class's; the class and every other allocator
are untouched). Each wrapper, built by one of the small functions below, calls SGLang's
method and records what it did in the journal of the replay-and-front policy
(`front_policy.FrontPolicy.journal`): a tuple appended to a list, nothing read from the
device, no lock. It asks the policy for a replay (`FrontPolicy.flush`) every `batch`
recorded calls and when an allocation went past the policy's budget (`soft_until`); a merge
voids the budget, `clear` makes the policy re-read SGLang's allocator. Everything else
(when rows are known mapped, pins, map-ahead, packing) is the policy's.

The full-token allocator (`full_attn_allocator`) is not wrapped: in a
DeepSeek-V4 pool its ids are logical (no buffer of their own).

`install()` starts the policy and shadows the methods; `remove()` deletes the instance
attributes, restoring the class methods, and replays what is left. Both are idempotent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from allocator.checks import check_count
from kvledger.engines.sglang.bridge.compat import WRAPPED_METHODS
from kvledger.engines.sglang.bridge.front_policy import NO_ROWS, FrontPolicy
from kvledger.engines.sglang.bridge.journal import MERGE, RELEASE, TAKE

BATCH = 64  # recorded calls between two replays

Wrapper = Callable[..., Any]


class AllocatorHooks:
    """Shadows the six methods of `allocator` (SGLang's PagedTokenToKVPoolAllocator, the
    one `policy` follows) while installed. `batch` is fixed at construction."""

    def __init__(self, allocator: Any, policy: FrontPolicy, *, batch: int = BATCH) -> None:
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
        if policy.allocator is not allocator:
            raise ValueError(
                f"policy follows {type(policy.allocator).__name__} object "
                f"{id(policy.allocator):#x}, expected the allocator being hooked "
                f"({id(allocator):#x})"
            )
        check_count("batch", batch, 1)
        self.allocator = allocator
        self.policy = policy
        self.batch = batch
        self.installed = False
        # The free list the allocation in progress takes from (the merged one after a merge).
        self.taking_from: Any = None
        self._wrappers: dict[str, Wrapper] = {
            name: _BUILDERS[name](getattr(allocator, name), self) for name in WRAPPED_METHODS
        }

    def install(self) -> None:
        """Start the policy (the front pinned, this thread the allocator's) and shadow the six
        methods; call from the thread that drives the allocator. Idempotent."""
        if self.installed:
            return
        self.policy.start()
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
        self.policy.flush(wait=True, owner=True)

    def __enter__(self) -> AllocatorHooks:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


# -- the wrappers: one small function builds each kind -------------------------------------
def _taking(fn: Wrapper, hooks: AllocatorHooks) -> Wrapper:
    """`alloc`, `alloc_extend`, `alloc_decode`: how many pages left the front of the list and
    the list they left (its first `taken` ids); a replay when past the budget or the batch.
    Runs every decode step on SGLang's scheduler thread: attribute reads and one append."""
    allocator, policy = hooks.allocator, hooks.policy
    journal = policy.journal
    raw, batch, flush = journal.raw, hooks.batch, policy.flush

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        journal.calls += 1  # odd: inside a call (see FrontPolicy._drain)
        hooks.taking_from = allocator.free_pages
        try:
            return fn(*args, **kwargs)
        finally:
            fp0 = hooks.taking_from
            hooks.taking_from = None
            taken = fp0.shape[0] - allocator.free_pages.shape[0]
            if taken > 0:
                if taken > journal.widest:
                    journal.widest = taken
                journal.net += taken
                raw.append((TAKE, fp0, taken, journal.net))
            journal.calls += 1
            if taken > 0 and (journal.net > policy.soft_until or len(raw) >= batch):
                flush(wait=False, owner=True)

    wrapper.__name__ = fn.__name__
    return wrapper


def _merging(fn: Wrapper, hooks: AllocatorHooks) -> Wrapper:
    """`merge_and_sort_free`: with staged pages the list is re-sorted, so no row of it is
    known mapped until a replay reads its new front."""
    allocator, policy = hooks.allocator, hooks.policy
    journal = policy.journal

    def merge_and_sort_free(*args: Any, **kwargs: Any) -> Any:
        if not allocator.staged_pages:
            return fn(*args, **kwargs)
        with policy.lock:
            out = fn(*args, **kwargs)
            journal.raw.append((MERGE, journal.net))
            policy.set_budget(NO_ROWS, NO_ROWS, "merge: SGLang re-sorted its free list")
        if hooks.taking_from is not None:
            hooks.taking_from = allocator.free_pages  # the allocation takes from the merged list
        return out

    return merge_and_sort_free


def _releasing(fn: Wrapper, hooks: AllocatorHooks) -> Wrapper:
    """`_release_page_ids`: the id tensors passed (referenced, not read); a replay when the
    batch is full."""
    allocator, policy = hooks.allocator, hooks.policy
    journal = policy.journal
    raw, batch, flush = journal.raw, hooks.batch, policy.flush

    def release_page_ids(*page_ids: Any) -> Any:
        journal.calls += 1
        try:
            out = fn(*page_ids)
            if not allocator.need_sort:  # in front of the list (else staged until a merge)
                for t in page_ids:
                    journal.net -= t.numel()
            raw.append((RELEASE, page_ids, journal.net))
        finally:
            journal.calls += 1
        if len(raw) >= batch:
            flush(wait=False, owner=True)
        return out

    return release_page_ids


def _clearing(fn: Wrapper, hooks: AllocatorHooks) -> Wrapper:
    """`clear`: every page free again; the policy re-reads SGLang's allocator."""
    policy = hooks.policy
    journal = policy.journal

    def clear(*args: Any, **kwargs: Any) -> Any:
        journal.calls += 1
        try:
            out = fn(*args, **kwargs)
            policy.resync()
        finally:
            journal.calls += 1
        return out

    return clear


_BUILDERS: dict[str, Callable[[Wrapper, AllocatorHooks], Wrapper]] = {
    "alloc": _taking,
    "alloc_extend": _taking,
    "alloc_decode": _taking,
    "merge_and_sort_free": _merging,
    "_release_page_ids": _releasing,
    "clear": _clearing,
}
