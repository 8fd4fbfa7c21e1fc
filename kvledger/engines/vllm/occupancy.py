"""The engine core's side: block occupancy of vLLM 0.33's scheduler, as ledger accounts.

The scheduler's `KVCacheManager` (`vllm/v1/core/kv_cache_manager.py`) owns a
coordinator whose one `BlockPool` (`vllm/v1/core/block_pool.py`) serves every KV-cache
group: a block id belongs to one group at a time. What the pool counts itself, O(1):
`num_gpu_blocks` and `free_block_queue.num_free_blocks` (free blocks, cached ones with
ref count 0 among them: they are evictable). The null block (block 0) is held for good.

Accounts (no bytes: the bytes are the workers'; slots only):

- `kv_pool`: blocks in use (ref count > 0, the null block included) of `num_gpu_blocks`;
- `kv_pool_evictable`: free blocks still holding a prefix-cache hash (evictable, reusable
  on a hit). The pool keeps no such counter; `EvictableCounter` keeps one by wrapping
  the pool's free queue (each insert and removal checks the blocks it moves, no walk over
  the pool) and `evict_blocks` / `reset_prefix_cache`. Without prefix caching it stays 0;
- `g<i>_<kind>` per group: the group's slots in use (its distinct blocks held by requests
  times its block size; a Mamba group's states), counted from the group manager's
  `req_to_blocks` (`vllm/v1/core/single_type_kv_cache_manager.py`) when a publish is due,
  never per step. A block shared by several requests (a prefix hit) is counted once, as
  the pool counts it: summed over groups, the blocks held are `kv_pool`'s in use less the
  null block. (A set of the held blocks' ids, built in C by `map(id, ...)`: O(blocks held)
  per publish, about 30 ns a block.)

Free blocks = `kv_pool` capacity - `kv_pool` occupied; of them `kv_pool_evictable` hold
cached prefixes.

Holders (accounting.figures.Held, SGLang's holder names), O(1) per publish, never a walk
over blocks: `EvictableCounter` also keeps the blocks holding a prefix-cache hash, by
wrapping the pool's `_insert_block_hash` and `_remove_cached_block_hashes` (where every
block gains or loses its hash) and `reset_prefix_cache`. A hashed block is free (counted
evictable) or in use, so of the blocks in use `tree_protected` = hashed - evictable and
`request_only` = the rest (the null block, held for good by vLLM itself, among them);
without prefix caching every block in use is `request_only`. vLLM counts a cached block
with ref count 0 as free, and kvledger keeps `kv_pool`'s occupied equal to vLLM's
"in use" (what `vllm:kv_cache_usage_perc` counts), so those blocks are not among
`kv_pool`'s holders: they are `kv_pool_evictable`'s, all `tree_evictable`. Each account's
holders add up to its own occupied slots, as the ledger requires.

Per group the same split, O(groups) per publish: the key vLLM caches a block under names
its group (`group_of_hash`), so the same wrappers keep, per group, the blocks holding a
hash and the free ones among them (O(1) per block they already check). A group's account
gets its cached blocks in use as `tree_protected` (the rest of its slots in use
`request_only`), and `evictable_g<i>_<kind>` its free cached blocks, all `tree_evictable`.
A key that names no group of the pool turns the split off: the groups' holders are then
unattributed. Duck-typed; nothing here imports vLLM.

Per-request footprints (`RequestFootprints`, `SchedulerOccupancy.footprints`): each running
request's blocks per group, read from the group managers' `req_to_blocks[request_id]`, and
its slots (blocks times the group's slots per block). In slots, not bytes: the engine core's
accounts carry no bytes (above), and `accounting.engine_state.request_violations` bounds a
request's bytes by its families' tensor bytes, which are 0 here, so they are not put in
an `EngineState` (whose figures are bytes) on this ledger. A request counts every block it
holds, shared ones (a prefix hit) included: footprints may sum to more than a group's
occupied slots, which count a shared block once. Cost per read: O(running requests x
groups), never a walk over the pool's blocks. Given `running` (the scheduler's running
list), each refresh reads them and keeps an `accounting.request_slots.RequestSlots` that the
ledger carries in every snapshot (`Ledger.set_request_slots`). A request's blocks in a group are its
list's length less the null blocks vLLM puts in place of blocks it no longer needs (out of
a sliding window or a local-attention chunk, skipped by a prefix hit): in vLLM 0.32 and
0.33 those lead the list, so they are found by bisection, O(log blocks). A state group
(`mamba`) may null blocks anywhere in the list: there the list is walked (one entry per
`block_size` tokens, a Mamba group's block size being large), O(that request's blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger
from accounting.request_slots import RequestSlots, request_slots
from kvledger.engines.vllm.groups import POOL_FAMILY, STATE_KINDS, GroupLayout, layouts

EVICTABLE_FAMILY = "kv_pool_evictable"
# A group's evictable blocks (free, cached, that group's) as its slots: `evictable_g<i>_<kind>`.
GROUP_EVICTABLE_PREFIX = "evictable_"


def _slot_account(ledger: Ledger, pool: str, family: str, capacity: int) -> Account:
    spec = BufferSpec(
        name=family,
        family=family,
        pool=pool,
        owner=Owner.RUNTIME,
        layer=None,
        dtype="none",
        shape=(),
        slot_bytes=0,
        capacity_slots=capacity,
        tensor_bytes=0,
        reserved_bytes=0,
    )
    return ledger.add_account([spec], key=f"{pool}/{family}")


_GROUP_0 = (0).to_bytes(4, "big")  # the end of a key of group 0 (`group_of_hash`)


def group_of_hash(key: Any) -> int | None:
    """The KV-cache group a prefix-cache key names: vLLM 0.32 and 0.33 key the cache by
    `BlockHashWithGroupId`, the block hash's bytes followed by the group id in 4 big-endian
    bytes (`vllm/v1/core/kv_cache_utils.py`, `get_group_id`); an older key is a tuple with
    a `group_id`. None for a key of neither shape."""
    if isinstance(key, bytes):
        return int.from_bytes(key[-4:], "big") if len(key) >= 4 else None
    g = getattr(key, "group_id", None)
    return g if type(g) is int else None


class EvictableCounter:
    """Free blocks that hold a prefix-cache hash, counted as blocks enter and leave the
    pool's free queue. `close()` (idempotent) takes the wrappers off."""

    _QUEUE_METHODS = ("append", "append_n", "prepend_n", "popleft", "popleft_n", "remove")
    _POOL_METHODS = ("evict_blocks", "reset_prefix_cache")
    # Where a block gains and loses its prefix-cache hash (vLLM 0.32 and 0.33: every
    # set_block_hash / reset_hash of the pool goes through them, reset_prefix_cache aside).
    _HASH_METHODS = ("_insert_block_hash", "_remove_cached_block_hashes")

    def __init__(self, block_pool: Any, groups: int = 1) -> None:
        self.pool = block_pool
        self.queue = block_pool.free_block_queue
        self.count = 0
        # Per KV-cache group (the group of a block's prefix-cache key, `group_of_hash`): its
        # evictable blocks, and (with `hashed`) its blocks holding a hash. `groups_known`
        # turns False for good if a key names no group of this pool's.
        self.groups = groups
        self.group_count = [0] * groups
        self.group_hashed = [0] * groups
        self.groups_known = True
        self._installed: list[tuple[Any, str]] = []
        q, p = self.queue, block_pool
        for owner, name in [(q, n) for n in self._QUEUE_METHODS] + [
            (p, n) for n in self._POOL_METHODS
        ]:
            if not callable(getattr(owner, name, None)):
                raise AttributeError(
                    f"{type(owner).__name__}.{name}: missing, expected vLLM 0.33's block pool"
                )
        # Blocks holding a hash, in use or free: kept only where the pool's hash methods
        # can be wrapped (else None: the holders of the blocks in use are not read).
        self.hashed: int | None = None
        # Hashed blocks already in the queue (none in a new pool): counted once, here.
        block = q.fake_free_list_head.next_free_block
        while block is not None and block is not q.fake_free_list_tail:
            self.count += self._group_add(self.group_count, block.block_hash, 1)
            block = block.next_free_block
        for name in ("append",):
            self._wrap(q, name, self._counting_one)
        for name in ("append_n", "prepend_n"):
            self._wrap(q, name, self._counting_many)
        self._wrap(q, "popleft", self._taking_one)
        self._wrap(q, "popleft_n", self._taking_many)
        self._wrap(q, "remove", self._removing)
        self._wrap(p, "evict_blocks", self._evict_wrapper)
        self._wrap(p, "reset_prefix_cache", self._reset_wrapper)
        if all(callable(getattr(p, n, None)) for n in self._HASH_METHODS):
            # Once, at start-up (none in a new pool); then O(1) per hash added or removed.
            self.hashed = sum(self._group_add(self.group_hashed, b.block_hash, 1) for b in p.blocks)
            self._wrap(p, "_insert_block_hash", self._inserting_hash)
            self._wrap(p, "_remove_cached_block_hashes", self._removing_hashes)

    def _group_add(self, counts: list[int], key: Any, sign: int) -> int:
        """1 when `key` is a prefix-cache key (its group's count in `counts` moved by
        `sign`), 0 for None."""
        if key is None:
            return 0
        if self.groups == 1 and type(key) is bytes and key.endswith(_GROUP_0):
            counts[0] += sign  # one group, a key naming it: no decode on the block path
            return 1
        # vLLM's own key (bytes) decoded inline: this runs for every cached block moved.
        g = (
            int.from_bytes(key[-4:], "big")
            if type(key) is bytes and len(key) >= 4
            else group_of_hash(key)
        )
        if g is not None and 0 <= g < self.groups:
            counts[g] += sign
        else:
            self.groups_known = False
        return 1

    def _moved(self, blocks: Any, sign: int) -> int:
        """Hashed blocks among `blocks` (entering the free queue: `sign` 1; leaving: -1),
        each counted to its group's evictable blocks."""
        counts, groups, n = self.group_count, self.groups, 0
        for b in blocks:
            key = b.block_hash
            if key is None:
                continue
            n += 1
            if groups == 1 and type(key) is bytes and key.endswith(_GROUP_0):
                counts[0] += sign  # one group, a key naming it: nothing decoded
                continue
            g = (
                int.from_bytes(key[-4:], "big")
                if type(key) is bytes and len(key) >= 4
                else group_of_hash(key)
            )
            if g is not None and 0 <= g < groups:
                counts[g] += sign
            else:
                self.groups_known = False
        return n

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        owner.__dict__[name] = make(getattr(owner, name))
        self._installed.append((owner, name))

    # Blocks entering the free queue: the hashed ones become evictable.
    def _counting_one(self, orig: Any) -> Any:
        def append(block: Any) -> None:
            self.count += self._group_add(self.group_count, block.block_hash, 1)
            orig(block)

        return append

    def _counting_many(self, orig: Any) -> Any:
        def insert_n(blocks: Any) -> None:
            self.count += self._moved(blocks, 1)
            orig(blocks)

        return insert_n

    # Blocks leaving it (handed out, or touched by a prefix hit).
    def _taking_one(self, orig: Any) -> Any:
        def popleft() -> Any:
            block = orig()
            self.count -= self._group_add(self.group_count, block.block_hash, -1)
            return block

        return popleft

    def _taking_many(self, orig: Any) -> Any:
        def popleft_n(n: int) -> Any:
            blocks = orig(n)
            self.count -= self._moved(blocks, -1)
            return blocks

        return popleft_n

    def _removing(self, orig: Any) -> Any:
        def remove(block: Any) -> None:
            self.count -= self._group_add(self.group_count, block.block_hash, -1)
            orig(block)

        return remove

    def _evict_wrapper(self, orig: Any) -> Any:
        def evict_blocks(block_ids: Any) -> Any:
            ids = list(block_ids)
            self.count -= self._free_hashed(ids, -1)  # those still cached after: added back
            result = orig(set(ids) if isinstance(block_ids, set) else ids)
            self.count += self._free_hashed(ids, 1)
            return result

        return evict_blocks

    def _free_hashed(self, ids: list[int], sign: int) -> int:
        """Free cached blocks among `ids` (O(len(ids))), each counted to its group."""
        blocks = self.pool.blocks
        n = 0
        for i in ids:
            if 0 <= i < len(blocks):
                b = blocks[i]
                if b.ref_cnt == 0 and not b.is_null:
                    n += self._group_add(self.group_count, b.block_hash, sign)
        return n

    def _reset_wrapper(self, orig: Any) -> Any:
        def reset_prefix_cache() -> Any:
            done = orig()
            if done:
                self.count = 0
                self.group_count = [0] * self.groups
                self.group_hashed = [0] * self.groups
                if self.hashed is not None:
                    self.hashed = 0
            return done

        return reset_prefix_cache

    # A block gaining its first hash, or losing all of them.
    def _inserting_hash(self, orig: Any) -> Any:
        def _insert_block_hash(block_hash: Any, block: Any, *rest: Any, **kw: Any) -> Any:
            before = block.block_hash is None
            result = orig(block_hash, block, *rest, **kw)
            if before and block.block_hash is not None and self.hashed is not None:
                self.hashed += self._group_add(self.group_hashed, block.block_hash, 1)
            return result

        return _insert_block_hash

    def _removing_hashes(self, orig: Any) -> Any:
        def _remove_cached_block_hashes(block: Any, *rest: Any, **kw: Any) -> Any:
            key = block.block_hash
            result = orig(block, *rest, **kw)
            if key is not None and block.block_hash is None and self.hashed is not None:
                self.hashed -= self._group_add(self.group_hashed, key, -1)
            return result

        return _remove_cached_block_hashes

    @property
    def protected(self) -> int | None:
        """Hashed blocks in use (ref count > 0): in the prefix cache and held by a
        request. A hashed block is either in the free queue (`count`) or in use."""
        return None if self.hashed is None else max(self.hashed - self.count, 0)

    def group_blocks(self) -> tuple[list[int], list[int]] | None:
        """Per group: (hashed blocks in use, evictable blocks), O(groups); None where a
        group is not known (the hash methods not wrapped, or a key naming no group)."""
        if self.hashed is None or not self.groups_known:
            return None
        evictable = self.group_count
        return [max(h - e, 0) for h, e in zip(self.group_hashed, evictable, strict=True)], list(
            evictable
        )

    def close(self) -> None:
        while self._installed:
            owner, name = self._installed.pop()
            owner.__dict__.pop(name, None)


@dataclass(frozen=True)
class RequestFootprint:
    """One running request's KV blocks and slots per KV-cache group (vLLM's group order),
    the null block excluded; shared blocks (a prefix hit) included."""

    rid: str
    tokens: int  # `num_computed_tokens`: tokens whose KV is computed
    blocks: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def total_slots(self) -> int:
        return sum(self.slots)


def _leading_nulls(blocks: Sequence[Any], null: Any) -> int:
    """How many entries lead `blocks` that are `null` (the null blocks a manager puts before
    a request's held ones), by bisection: O(log len(blocks))."""
    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid] is null:
            lo = mid + 1
        else:
            hi = mid
    return lo


class RequestFootprints:
    """Reads running requests' footprints from a `KVCacheManager`'s group managers
    (`coordinator.single_type_managers[i].req_to_blocks`), O(running x groups)."""

    def __init__(self, managers: Sequence[Any], layouts_: Sequence[GroupLayout], null: Any):
        if len(managers) != len(layouts_):
            raise ValueError(
                f"RequestFootprints: {len(managers)} group managers for {len(layouts_)} groups"
            )
        self._groups = tuple(
            (m.req_to_blocks, g.slots_per_block, g.kind in STATE_KINDS)
            for m, g in zip(managers, layouts_, strict=True)
        )
        self._null = null

    def read(self, running: Iterable[Any]) -> list[RequestFootprint]:
        """The footprints of `running` (vLLM `Request`s: `request_id`, `num_computed_tokens`),
        in their order; a request no group holds blocks for has all zeros."""
        return [
            RequestFootprint(str(rid), tokens, blocks, slots)
            for rid, tokens, blocks, slots in self.rows(running)
        ]

    def rows(
        self, running: Iterable[Any]
    ) -> Iterator[tuple[Any, int, tuple[int, ...], tuple[int, ...]]]:
        """(request id, computed tokens, blocks per group, slots per group) of each of
        `running`: what `read` returns, without building a record per request (a publish
        reads every running request)."""
        null = self._null
        groups = self._groups
        for req in running:
            rid = req.request_id
            blocks: list[int] = []
            slots: list[int] = []
            for table, per_block, anywhere in groups:
                held = table.get(rid)  # get: never creates an entry in the defaultdict
                if not held:
                    n = 0
                elif anywhere:
                    n = sum(1 for b in held if b is not null)
                elif held[0] is not null:  # the common case: nothing skipped
                    n = len(held)
                else:
                    n = len(held) - _leading_nulls(held, null)
                blocks.append(n)
                slots.append(n * per_block)
            yield rid, int(req.num_computed_tokens or 0), tuple(blocks), tuple(slots)


class SchedulerOccupancy:
    """The engine core's accounts, refreshed from a `KVCacheManager` by `refresh()`
    (call it on the scheduler's thread: it reads the managers' request tables)."""

    def __init__(
        self,
        ledger: Ledger,
        kv_cache_manager: Any,
        *,
        kind_of: Callable[[Any], str],
        pool: str = "vllm",
        running: Callable[[], Iterable[Any]] | None = None,
    ) -> None:
        """`running`: the scheduler's running requests (`lambda: scheduler.running`), read at
        each refresh for their footprints (`request_slots`); None: no footprints published."""
        self.ledger = ledger
        self.running = running
        self.request_slots: RequestSlots | None = None
        self.manager = kv_cache_manager
        coordinator = kv_cache_manager.coordinator
        self.block_pool = coordinator.block_pool
        self.managers = tuple(coordinator.single_type_managers)
        self.layouts: list[GroupLayout] = layouts(kv_cache_manager.kv_cache_config, kind_of)
        if len(self.layouts) != len(self.managers):
            raise ValueError(
                f"KVCacheManager: {len(self.managers)} group managers for "
                f"{len(self.layouts)} KV-cache groups, expected one per group"
            )
        self.num_blocks = int(self.block_pool.num_gpu_blocks)
        self.null_block = self.block_pool.null_block
        self.request_footprints = RequestFootprints(self.managers, self.layouts, self.null_block)
        self.rows = self.request_footprints.rows
        self.families = tuple(g.family for g in self.layouts)
        self.accounts: list[Account] = []
        self.evictable: EvictableCounter | None = None
        # Set by kvledger's wrapper of Scheduler.schedule: a step ran since the last refresh.
        self.dirty = False
        try:
            self.pool_account = _slot_account(ledger, pool, POOL_FAMILY, self.num_blocks)
            self.accounts.append(self.pool_account)
            self.evictable_account = _slot_account(ledger, pool, EVICTABLE_FAMILY, self.num_blocks)
            self.accounts.append(self.evictable_account)
            self.group_accounts = []
            for g in self.layouts:
                acc = _slot_account(ledger, pool, g.family, g.capacity_slots)
                self.accounts.append(acc)
                self.group_accounts.append(acc)
            if getattr(self.block_pool, "enable_caching", False):
                self.evictable = EvictableCounter(self.block_pool, len(self.layouts))
            # Each group's evictable slots: kept where the groups of cached blocks are read.
            self.group_evictable_accounts: list[Account] = []
            if self.evictable is not None and self.evictable.hashed is not None:
                for g in self.layouts:
                    family = GROUP_EVICTABLE_PREFIX + g.family
                    acc = _slot_account(ledger, pool, family, g.capacity_slots)
                    self.accounts.append(acc)
                    self.group_evictable_accounts.append(acc)
            if running is not None:
                ledger.set_request_slots(self._published_slots)
            self.refresh()
        except BaseException:
            self.close()
            raise

    def counts(self) -> dict[str, int]:
        """Blocks: in use, free, evictable, in use and cached (`protected`; -1 when not
        read); and each group's slots in use."""
        free = int(self.block_pool.free_block_queue.num_free_blocks)
        protected: int | None = 0  # no prefix caching: no block in use is cached
        if self.evictable is not None:
            protected = self.evictable.protected
        out = {
            "blocks": self.num_blocks,
            "in_use": self.num_blocks - free,
            "free": free,
            "evictable": self.evictable.count if self.evictable is not None else 0,
            "protected": -1 if protected is None else protected,
        }
        null = id(self.null_block)
        for g, manager in zip(self.layouts, self.managers, strict=True):
            held: set[int] = set()
            for blocks in manager.req_to_blocks.values():
                held.update(map(id, blocks))
            held.discard(null)
            out[g.family] = len(held) * g.slots_per_block
        return out

    def footprints(self, running: Iterable[Any]) -> list[RequestFootprint]:
        """Each of `running`'s blocks and slots per group (`RequestFootprints.read`); call
        it on the scheduler's thread, with `Scheduler.running`."""
        return self.request_footprints.read(running)

    def _published_slots(self) -> RequestSlots | None:
        return self.request_slots  # read under the ledger's lock: what the last refresh read

    def refresh(self) -> dict[str, int]:
        c = self.counts()
        _set(self.pool_account, c["in_use"])
        _set(self.evictable_account, c["evictable"])
        # Holders (accounting.figures.Held), O(1): of the blocks in use, the cached ones are
        # tree_protected and the rest request_only (the null block among them); the
        # evictable blocks, free to vLLM, are their own account's, all tree_evictable.
        if c["protected"] < 0:
            self.pool_account.clear_holders()
        else:
            self.pool_account.set_holders(min(c["protected"], max(c["in_use"] - 1, 0)), 0)
        self.evictable_account.set_holders(0, c["evictable"])
        for g, acc in zip(self.layouts, self.group_accounts, strict=True):
            _set(acc, min(c[g.family], acc.capacity_slots))
        self._group_holders()
        if self.running is not None:
            self.request_slots = request_slots(
                self.families,
                ((rid, tokens, slots) for rid, tokens, _, slots in self.rows(self.running())),
            )
        return c

    def _group_holders(self) -> None:
        """Each group's holders, O(groups): of its slots in use, its cached blocks in use
        are tree_protected, the rest request_only; its evictable blocks are its
        `evictable_g<i>_<kind>` account's, all tree_evictable. Not read (unattributed) where
        the groups of cached blocks are not known."""
        split = self.evictable.group_blocks() if self.evictable is not None else None
        for i, (g, acc) in enumerate(zip(self.layouts, self.group_accounts, strict=True)):
            if self.evictable is None:  # no prefix caching: nothing in use is cached
                acc.set_holders(0, 0)
            elif split is None:
                acc.clear_holders()
            else:
                acc.set_holders(min(split[0][i] * g.slots_per_block, acc.occupied_slots), 0)
        # (none without prefix caching: zip then stops at once)
        evictable = zip(self.layouts, self.group_evictable_accounts, strict=False)
        for i, (g, acc) in enumerate(evictable):
            slots = 0 if split is None else min(split[1][i] * g.slots_per_block, acc.capacity_slots)
            _set(acc, slots)
            if split is None:
                acc.clear_holders()
            else:
                acc.set_holders(0, slots)

    def close(self) -> None:
        """Unwrap the pool and remove the accounts. Idempotent."""
        if self.evictable is not None:
            self.evictable.close()
            self.evictable = None
        if self.running is not None:
            self.running = None
            self.request_slots = None
            self.ledger.set_request_slots(None)
        for acc in reversed(self.accounts):
            acc.on_slots(0, acc.peak_occupied_slots)
            self.ledger.remove_account(acc)
        self.accounts = []


def _set(account: Account, occupied: int) -> None:
    account.on_slots(occupied, max(account.peak_occupied_slots, occupied))
