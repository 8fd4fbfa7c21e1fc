"""vLLM 0.34's extensible (VMM) KV cache as the worker's `kv_pool` account.

With the extensible KV cache (on by default on CUDA in 0.34), the V2 runner's
`initialize_kv_cache` builds an `ExtensibleKVCache` (`vllm/v1/worker/extensible_kv_cache.py`)
whose `buffer` is an `ExtensibleTensor` (`vllm/utils/extensible_tensor.py`): one virtual
address reservation (`cuMemAddressReserve`) for `capacity_blocks` blocks, of which a prefix
is backed by physical chunks (`cuMemCreate` + `cuMemMap`) granule by granule as vLLM
commits blocks: `allocate` commits the null block, warm-up commits as it goes,
`extend_kv_cache` commits the final count, sleep releases every chunk
(`release_physical`) and wake-up commits them again (`recommit`), `free` gives the
reservation back. vLLM exports none of these figures. kvledger reads them from vLLM's own
objects, as a VMM-owned account:

- account `kv_pool`, one buffer `kv_cache`, owner `vmm`, `page_bytes` = the buffer's
  commit granule (`ExtensibleTensor.granularity`, 2 MiB on CUDA):
  - tensor bytes = `ExtensibleKVCache.size`: the allocation every layer view is carved
    from, all `capacity_blocks` blocks of it, backed or not (the whole virtual extent, as
    for any VMM buffer);
  - reserved bytes = `ExtensibleTensor.capacity_bytes`: the reservation, that size rounded
    up to the granule;
  - physical = mapped bytes = `ExtensibleTensor.physical_bytes`: the granules backed now
    (vLLM maps every chunk it creates), each segment's committed prefix rounded up to
    whole granules;
  - `capacity_slots` = `capacity_blocks`, `slot_bytes` = `bytes_per_block` (one block id
    in every layer of every group).
- account `kv_pool_committed` (no bytes): `capacity_slots` = `capacity_blocks`,
  `occupied_slots` = the blocks backed now (`ExtensibleTensor.num_bytes //
  bytes_per_block`: every segment holds the same count of blocks, so this is exact; 0
  while the cache is released for sleep). Slots only, like the engine core's
  `kv_pool_evictable`.

How the physical figure follows vLLM: every mapping and unmapping of an ExtensibleTensor
goes through three of its methods (`resize_segments_`, which `ExtensibleKVCache.commit`,
`allocate` and `recommit` call; `release_physical`, which `commit`'s remap and
`ExtensibleKVCache.release_physical` call; `free`). kvledger wraps those three on the class
(`hooks`): after each call on a registered buffer, `CommitFollower.sync` reads
`physical_bytes` and `num_bytes` (O(1): a set's length and a list's sum of a few
segments) and reports the change, with the call's duration as the map (or unmap) time.
Nothing runs per step or per publish; a call on a buffer kvledger did not register costs
one attribute lookup. Re-reading at every publish instead would cost a read per heartbeat
forever, and a remap (`commit(..., shrink=True)` unmaps everything, then maps the smaller
prefix) would be seen as one net change, not as the unmap and the map it is.

The granules vLLM committed before kvledger registered the cache (`allocate` commits the
null block inside `initialize_kv_cache`) are reported when it registers, with no map time.
Nothing here imports vLLM or torch: the objects are read by attribute.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.events import PoolEvent
from accounting.ledger import Account, Ledger

log = logging.getLogger(__name__)

POOL_FAMILY = "kv_pool"
COMMITTED_FAMILY = "kv_pool_committed"
# The attribute of a registered ExtensibleTensor that names its follower.
FOLLOWER_ATTR = "_kvledger_follower"


@dataclass(frozen=True)
class Reservation:
    """The fixed figures of one ExtensibleKVCache."""

    tensor_bytes: int  # ExtensibleKVCache.size: what the views are carved from
    reserved_bytes: int  # ExtensibleTensor.capacity_bytes: the reservation
    granule_bytes: int  # ExtensibleTensor.granularity: the unit physical memory comes in
    capacity_blocks: int
    block_bytes: int  # ExtensibleKVCache.bytes_per_block


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"vLLM's {what}={value!r}, expected a positive int")
    return value


def reservation_of(cache: Any) -> Reservation:
    """The figures of an `ExtensibleKVCache`, checked: a value that is not a positive int, a
    reservation smaller than the allocation or not a whole number of granules raises a
    ValueError naming it."""
    buffer = cache.buffer
    r = Reservation(
        tensor_bytes=_positive(cache.size, "ExtensibleKVCache.size"),
        reserved_bytes=_positive(buffer.capacity_bytes, "ExtensibleTensor.capacity_bytes"),
        granule_bytes=_positive(buffer.granularity, "ExtensibleTensor.granularity"),
        capacity_blocks=_positive(cache.capacity_blocks, "ExtensibleKVCache.capacity_blocks"),
        block_bytes=_positive(cache.bytes_per_block, "ExtensibleKVCache.bytes_per_block"),
    )
    if r.reserved_bytes < r.tensor_bytes or r.reserved_bytes % r.granule_bytes:
        raise ValueError(
            f"vLLM's ExtensibleTensor.capacity_bytes={r.reserved_bytes}, expected a whole "
            f"number of {r.granule_bytes}-byte granules covering ExtensibleKVCache.size="
            f"{r.tensor_bytes}"
        )
    if r.capacity_blocks * r.block_bytes > r.tensor_bytes:
        raise ValueError(
            f"vLLM's ExtensibleKVCache: capacity_blocks={r.capacity_blocks} x bytes_per_block="
            f"{r.block_bytes} exceeds size={r.tensor_bytes}, expected the blocks to fit"
        )
    return r


def pool_spec(r: Reservation, *, pool: str) -> BufferSpec:
    return BufferSpec(
        name="kv_cache",
        family=POOL_FAMILY,
        pool=pool,
        owner=Owner.VMM,
        layer=None,
        dtype="uint8",  # ExtensibleTensor.full_view(): one uint8 view of the allocation
        shape=(r.tensor_bytes,),
        slot_bytes=r.block_bytes,
        capacity_slots=r.capacity_blocks,
        tensor_bytes=r.tensor_bytes,
        reserved_bytes=r.reserved_bytes,
    )


def committed_spec(r: Reservation, *, pool: str) -> BufferSpec:
    return BufferSpec(
        name="kv_cache_committed",
        family=COMMITTED_FAMILY,
        pool=pool,
        owner=Owner.RUNTIME,
        layer=None,
        dtype="uint8",
        shape=(),
        slot_bytes=0,
        capacity_slots=r.capacity_blocks,
        tensor_bytes=0,
        reserved_bytes=0,
    )


class CommitFollower:
    """The `kv_pool` and `kv_pool_committed` accounts of one ExtensibleKVCache, kept equal
    to its buffer's backed granules and blocks by `sync()`, which the wrapped
    ExtensibleTensor methods call. Holds the cache weakly (kvledger must not keep vLLM's
    device memory alive); if the cache is collected unfreed, its figures go to 0.
    `release(ledger)` (idempotent) zeroes them and removes both accounts."""

    def __init__(self, ledger: Ledger, cache: Any, *, pool: str = "vllm") -> None:
        self.reservation = r = reservation_of(cache)
        self._buffer = weakref.ref(cache.buffer, self._collected)
        self._lock = threading.RLock()  # the collection callback may run inside sync
        self._pages = 0
        self._blocks = 0
        self._peak_blocks = 0
        self._closed = False
        self.pool_account: Account | None = ledger.add_account(
            [pool_spec(r, pool=pool)], key=f"{pool}/{POOL_FAMILY}", page_bytes=r.granule_bytes
        )
        self.committed_account: Account | None = None
        try:
            self.committed_account = ledger.add_account(
                [committed_spec(r, pool=pool)], key=f"{pool}/{COMMITTED_FAMILY}"
            )
            self.sync()
            setattr(cache.buffer, FOLLOWER_ATTR, self)
        except BaseException:
            self.release(ledger)
            raise

    @property
    def cache_pages(self) -> int:
        return self._pages

    @property
    def committed_blocks(self) -> int:
        return self._blocks

    def read(self) -> tuple[int, int]:
        """(granules, blocks) the buffer backs now; (0, 0) once it is gone."""
        buffer = self._buffer()
        if buffer is None:
            return 0, 0
        r = self.reservation
        physical = int(buffer.physical_bytes)
        if physical < 0 or physical % r.granule_bytes or physical > r.reserved_bytes:
            raise ValueError(
                f"vLLM's ExtensibleTensor.physical_bytes={physical}, expected a whole number "
                f"of {r.granule_bytes}-byte granules within the reservation of "
                f"{r.reserved_bytes}"
            )
        blocks = int(buffer.num_bytes) // r.block_bytes
        return physical // r.granule_bytes, min(blocks, r.capacity_blocks)

    def sync(self, seconds: float = 0.0) -> None:
        """Report the change since the last sync; `seconds`: how long the vLLM call that
        made it took (the map or unmap time)."""
        pages, blocks = self.read()
        with self._lock:
            if not self._closed:
                self._set(pages, blocks, seconds)

    def _set(self, pages: int, blocks: int, seconds: float) -> None:
        pool, committed = self.pool_account, self.committed_account
        delta = pages - self._pages
        if pool is not None and delta > 0:
            pool.on_pool_event(PoolEvent.HANDLES_CREATED, delta)
            pool.on_pool_event(PoolEvent.PAGES_MAPPED, delta, seconds)
        elif pool is not None and delta < 0:
            pool.on_pool_event(PoolEvent.PAGES_UNMAPPED, -delta, seconds)
            pool.on_pool_event(PoolEvent.HANDLES_RELEASED, -delta)
        self._pages = pages
        if committed is not None and blocks != self._blocks:
            self._peak_blocks = max(self._peak_blocks, blocks)
            committed.on_slots(blocks, self._peak_blocks)
            self._blocks = blocks

    def _collected(self, _ref: Any) -> None:
        # The buffer was garbage-collected (its own __del__ frees the memory).
        with self._lock:
            if not self._closed:
                self._set(0, 0, 0.0)

    def release(self, ledger: Ledger) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._set(0, 0, 0.0)
            accounts = [a for a in (self.committed_account, self.pool_account) if a is not None]
            self.pool_account = self.committed_account = None
        buffer = self._buffer()
        if buffer is not None and getattr(buffer, FOLLOWER_ATTR, None) is self:
            delattr(buffer, FOLLOWER_ATTR)
        for account in accounts:
            ledger.remove_account(account)


def follower_of(buffer: Any) -> CommitFollower | None:
    """The follower registered on an ExtensibleTensor, if any (one dict lookup)."""
    found = getattr(buffer, "__dict__", {}).get(FOLLOWER_ATTR)
    return found if isinstance(found, CommitFollower) else None


# -- the wrapped ExtensibleTensor methods ------------------------------------------------


def tensor_patches(
    guard: Callable[..., None], on_free: Callable[[CommitFollower], None]
) -> list[Any]:
    """MethodPatches (not applied) of `ExtensibleTensor`'s three methods: after each call on
    a registered buffer, its follower syncs, timed; after `free`, `on_free(follower)`.
    `guard(what, fn, *args)` runs kvledger's part (a failure turns kvledger off, vLLM carries
    on)."""
    import importlib

    from kvledger.engines.vllm.compat import TENSOR_MODULE
    from kvledger.engines.vllm.patch import MethodPatch

    cls = importlib.import_module(TENSOR_MODULE).ExtensibleTensor

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            follower = follower_of(self)
            if follower is None:
                return original(self, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                took = time.perf_counter() - start
                guard("following the KV cache's committed memory", follower.sync, took)

        return wrapper

    def freeing(original: Callable[..., Any]) -> Callable[..., Any]:
        def free(self: Any, *args: Any, **kwargs: Any) -> Any:
            follower = follower_of(self)
            try:
                return original(self, *args, **kwargs)
            finally:
                if follower is not None:
                    guard("releasing the freed KV cache", on_free, follower)

        return free

    return [
        MethodPatch(cls, "resize_segments_", timed),
        MethodPatch(cls, "release_physical", timed),
        MethodPatch(cls, "free", freeing),
    ]
