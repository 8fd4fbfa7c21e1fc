"""Compaction of a bridged SGLang pool: held SWA rows moved out of sparse VMM pages.

SGLang 0.5.23 reaches a token's SWA slot only through the allocator's
`full_to_swa_index_mapping` (its request-to-token table holds full-attention ids; every
reader translates them when it builds a batch), so a held SWA page (one row of every
layer buffer) can be moved: copy the row's bytes in every layer to a free row, rewrite
the mapping's entries that point into it, and swap the two page ids in the free list (the
old row becomes free, the new one is taken). `allocator.rows.compaction.plan` picks the moves
so that the sparsest VMM pages empty into the other pages in use (or, when none can,
`allocator.rows.compaction.slide` moves the highest pages' rows down to where the held rows
would lie packed, mapping the gaps it fills when it takes them).

It never waits for the device on the calling (scheduler's) thread:
- the journal is replayed without waiting; ids still being read (queued behind a forward
  that has not run) make the call move nothing and return 0: the next call compacts
  (`Bridge.compactions_deferred` counts these);
- spares fenced behind work still queued are not waited for: the background mapper waits
  for their fences off this thread and unmaps them (the store's trim skips a fenced page);
- the pages the moves empty carry an event recorded behind the copies (the fence rule,
  with a stream's event enough because no batch that read them is in flight) and are
  unmapped by the first trim that finds it signalled, on this thread or the mapper's;
- on CUDA the row ids go up through pinned memory without blocking, and the mapping's
  rewrite is computed on the device (no read-back of the pages to rewrite).

When it may run: `Bridge.compact()` is the caller's to call, on the thread that drives
the allocator, between batches, when no batch that has already translated SWA ids is still
to run (SGLang's overlap scheduler prepares the next batch while one runs: call it where
neither is in flight), and not while HiCache or a PD transfer holds SWA ids. The copies
and the mapping's rewrite are queued on the current stream, so later kernels see them.
"""

from __future__ import annotations

from typing import Any

from allocator.errors import CapacityError, DriverError
from allocator.rows import compaction, packing
from kvledger.engines.sglang.bridge import remap

MAX_MOVES = 512  # rows moved by one call at most


def compact(bridge: Any, *, max_moves: int = MAX_MOVES) -> int:
    """Move held rows so that sparse VMM pages empty, plan after plan until the mapped pages
    are within ceil(held rows / rows per page) + spares + 1 or `max_moves` rows moved;
    returns the rows moved (0 when the held rows already fill as few pages as they can, or
    nothing fits)."""
    policy, f, store = bridge.policy, bridge.follower, bridge.store
    if not policy.on_owner_thread():
        raise RuntimeError(
            f"{store.name}: compact() from another thread than the one driving SGLang's "
            "allocator, expected a call between batches on the scheduler's thread"
        )
    owner = bridge.swa_owner
    mapping = getattr(owner, "full_to_swa_index_mapping", None)
    sub = policy.allocator
    if mapping is None or getattr(sub, "staged_pages", None):
        return 0  # no mapping to rewrite, or staged pages: the list is not every free row
    policy.flush(wait=False)
    if len(policy.journal):
        # ids SGLang freed are still being read behind work in flight: the follower is not
        # SGLang's list yet, and waiting for them would block this thread on the device
        bridge.compactions_deferred += 1
        return 0
    moved = 0
    with policy.exclusive():
        while moved < max_moves:
            with store.lock:
                sources, targets = _next_plan(f, store, max_moves - moved)
            if not sources:
                break
            _apply(bridge, mapping, sub, sources, targets)
            moved += len(sources)
        if moved:
            policy.pack_if_short()  # the moves took free rows the front was counting on
    bridge.rows_moved += moved
    return moved


def _next_plan(f: Any, store: Any, max_moves: int) -> tuple[list[int], list[int]]:
    """The next moves (under the store's lock), or none when the pages mapped are within the
    bound already or no move helps (the spare waiting out its grace is unmapped then)."""
    # A map the background mapper has in flight is not counted yet, and it may finish after
    # the trims below: wait for it, or it leaves a spare over the bound behind this call.
    while store.busy and not store.closed:
        store.cond.wait(timeout=1.0)
    # within ceil(held / rows per page) + spares + 1 already, and still once the mapper has
    # mapped the spares it may map ahead
    if not packing.over_bound_soon(f):
        return [], []
    if store.policy.fences:
        # Spares freed by finishes, over the watermark: those whose fences have signalled go
        # now; the rest are the background mapper's to wait for, off this thread.
        store.policy.trim_locked()
        store.cond.notify_all()
        if not packing.over_bound_soon(f):
            return [], []
    # Over only by the page the mapper may map ahead in a stale spare's place: the stale one
    # goes now (it would after its grace), and no row moves.
    at_watermark = len(store.spares) == store.policy.max_spare_pages
    if (
        at_watermark
        and not packing.fragmented(f)
        and _trim_stale_spare(store)
        and not packing.over_bound_soon(f)
    ):
        return [], []
    sources, targets = compaction.plan(f, max_moves=max_moves)
    if not sources and compaction.in_use_beyond_packed(f) > 1:
        # no page empties into the others: held rows scattered one page apart, each
        # straddling row wasted; slide them down to where they would lie packed
        sources, targets = compaction.slide(f, max_moves=max_moves)
    if not sources:
        store.policy.trim_locked()
        return [], []
    # The destinations are taken before the copies, under the lock: their pages are in use
    # (mapped first, for a slide's gaps), so no trim can unmap them under the copies.
    try:
        f.take(targets, count_waits=False)
    except (CapacityError, DriverError):  # counted by the store; nothing moves
        return [], []
    return sources, targets


def _trim_stale_spare(store: Any) -> bool:
    """Unmap a spare neither pinned nor wanted ahead whose fence is done (lock held); False
    when there is none or the unmap failed."""
    policy = store.policy
    for p in reversed(store.spares):
        fence = policy.fences.get(p)
        if policy.stale(p) and (fence is None or fence.done()):
            return bool(store.unmap_spare_locked(p))
    return False


def _apply(bridge: Any, mapping: Any, sub: Any, sources: list[int], targets: list[int]) -> None:
    policy, f, store = bridge.policy, bridge.follower, bridge.store
    try:
        _move(bridge, mapping, sub, sources, targets)
    except BaseException:
        f.give_back(targets, policy.reader.fence_now())  # SGLang still holds the sources
        raise
    # No batch that read the source rows is in flight (the caller's precondition): the
    # copies just queued are the last work reading them, so an event after them fences
    # their pages. Not waited for here: the first trim that finds it signalled unmaps them.
    fence = policy.reader.stream_fence()
    f.give_back(sources, fence, trim=False)
    swapped = dict(zip(targets, sources, strict=True))
    # The new front: the spares get no new fence (no batch in flight).
    policy.pin([swapped.get(r, r) for r in policy.front], fence_spares=False)
    with store.lock:
        if not store.closed:
            store.policy.trim_locked()  # emptied by a move, not by a finish: no grace to wait
            store.cond.notify_all()  # the mapper unmaps those still fenced once they signal


def _move(bridge: Any, mapping: Any, sub: Any, sources: list[int], targets: list[int]) -> None:
    import torch

    dev = mapping.device
    src = _upload(torch, sources, dev)
    dst = _upload(torch, targets, dev)
    _copy_rows(bridge.tensors, sources, targets, src, dst)
    rows = bridge.follower.rows
    remap.rewrite(mapping, int(sub.page_size), rows, src, dst)
    sub.free_pages = _swapped(torch, sub.free_pages, rows, src, dst)


def _swapped(torch: Any, free_pages: Any, rows: int, src: Any, dst: Any) -> Any:
    """The free list with each target's id replaced by its source's (a new tensor)."""
    swap = torch.arange(rows, dtype=torch.int64, device=src.device)
    swap[dst] = src
    return swap[free_pages].to(free_pages.dtype)


def warm_up(bridge: Any, *, host: bool = False) -> bool:
    """Run once, on scratch tensors, every device kernel a compaction launches: the row
    gather and scatter of each layer dtype at the rows' width, the mapping's masked rewrite,
    the free list's swap, and the upload through pinned memory. The first compaction in a
    process otherwise pays for loading those kernels and the first pinned buffer on the
    scheduler's thread: 67.0 and 67.9 ms of host work in one step, once per process, on an
    H100 (`kvledger bench sglang --part serving`, docs/benchmarks.md). Nothing of the
    engine's state is touched; the work is queued on the current stream and not waited
    for. Returns False (and does nothing) where there is nothing to warm: no mapping, or a
    pool on the host (unless `host`: the same steps on the host, for tests)."""
    import torch

    mapping = getattr(bridge.swa_owner, "full_to_swa_index_mapping", None)
    sub = bridge.policy.allocator if bridge.policy is not None else None
    if mapping is None or sub is None or (mapping.device.type == "cpu" and not host):
        return False
    dev, page = mapping.device, int(sub.page_size)
    src, dst = _upload(torch, [1], dev), _upload(torch, [0], dev)
    for dtype, width in {(t.dtype, int(t.shape[1])) for t in bridge.tensors}:
        _copy_rows([torch.zeros((2, width), dtype=dtype, device=dev)], [1], [0], src, dst)
    # two full pages, the first in SWA row 0 (zeros), the second in row 1, and SGLang's -1
    scratch = torch.cat([torch.zeros(page), torch.arange(page, 2 * page), torch.tensor([-1])]).to(
        device=dev, dtype=mapping.dtype
    )
    remap.rewrite(scratch, page, 2, src, dst)
    free = sub.free_pages
    _swapped(torch, torch.zeros(1, dtype=free.dtype, device=free.device), 2, src, dst)
    return True


def _upload(torch: Any, ids: list[int], dev: Any) -> Any:
    """`ids` as an int64 tensor on `dev`. On a device through pinned memory, without blocking
    (a copy from pageable memory waits for the stream); torch's pinned-memory cache keeps
    the host buffer until the copy has run."""
    host = torch.tensor(ids, dtype=torch.int64)
    if dev.type == "cpu":
        return host
    return host.pin_memory().to(dev, non_blocking=True)


def _copy_rows(
    tensors: list[Any], sources: list[int], targets: list[int], src: Any, dst: Any
) -> None:
    """Row `sources[i]` copied to row `targets[i]` in every layer tensor (the two sets are
    disjoint: targets were free, sources held). On the host one `copy_` per row: a row is
    contiguous, so each runs at memcpy speed, where `index_select` + `index_copy_` over uint8
    rows move them byte by byte (6 rows of 146 KiB: 0.65 ms against 0.05 ms on one thread
    here, docs/benchmarks-history.md). On a device one gather and one scatter per layer (a launch
    per row would cost more than the copy)."""
    if src.device.type == "cpu":
        pairs = list(zip(sources, targets, strict=True))
        for t in tensors:
            for s, d in pairs:
                t[d].copy_(t[s])
        return
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))
