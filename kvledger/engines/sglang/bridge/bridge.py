"""Attach kvledger's VMM pool to a live SGLang 0.5.23 DeepSeek-V4 pool, and detach it.

What changes on attach (nothing unless `KVLEDGER_SGLANG_DSV4_BRIDGE=1`):

- `pool.swa_kv_pool.kv_buffer[i]` (the only place SGLang keeps a layer's SWA
  buffer; every reader goes through it: `get_swa_raw_buffer`,
  `get_swa_key_buffer_radix`, `set_swa_key_buffer`, the state/HiCache buffer
  infos) becomes a tensor over layer `i`'s VMM range, same shape
  `[rows, row_bytes]`, dtype uint8 and contiguity. The list object is kept and
  its items replaced, so holders of the list see the new tensors. Holders of the
  old tensors or their addresses do not: attach before CUDA graph capture,
  HiCache and PD registration.
- One engine page is one row of a page store (allocator.store) followed by a
  `RowFollower` (allocator.rows); the rows SGLang already handed out and row 0
  (its padding page) are copied over. A background mapper (allocator.mapper)
  maps the rows at the front of SGLang's free list ahead and unmaps spares
  behind, unless `pool_options` says `map_ahead=False`.
- The SWA sub-allocator is hooked (`allocator_hooks`: what it did recorded in a
  journal) and followed (`front_policy`: the journal replayed onto the follower, the
  front of its free list kept mapped); on CUDA the page ids it frees are read back
  without a device synchronisation and fence their pages (see `readback`).
- The ledger gets the swa_kv family as a VMM account fed by the pool's events,
  and every other family as runtime-owned (SGLang keeps C4/C128, indexer and
  state pools).

`detach()` undoes all of it: native tensors come back with the live rows
copied, the hooks go, every page is unmapped and released, the backend is
closed (when the bridge made it) and the accounts `attach` registered are
removed from the ledger. The pool can be attached again afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from accounting.ledger import Account, Ledger, LedgerError
from allocator.backend import Backend
from allocator.errors import IncompatibleError
from allocator.mapper import BackgroundMapper
from allocator.rows import RowFollower
from allocator.slots import SlotLayout
from allocator.store import PageStore
from kvledger.engines.sglang.bridge import registry
from kvledger.engines.sglang.bridge.allocator_hooks import AllocatorHooks
from kvledger.engines.sglang.bridge.compat import (
    SwaFacts,
    incompatibilities,
    pool_reasons,
    read_facts,
)
from kvledger.engines.sglang.bridge.front_policy import AHEAD_PAGES, AHEAD_ROWS, FrontPolicy
from kvledger.engines.sglang.bridge.readback import reader_for
from kvledger.engines.sglang.bridge.swa_buffers import FAMILY, native_copy, swa_specs
from kvledger.engines.sglang.switches import BRIDGE_ENABLE, BRIDGE_REQUIRE, BridgeActivation

log = logging.getLogger(__name__)

# pool -> its bridge. Kept here, not as an attribute of SGLang's pool, so nothing of the
# bridge is reachable from the pool object (the inventory walks it for stray tensors).
_BRIDGES: weakref.WeakKeyDictionary[Any, Bridge] = weakref.WeakKeyDictionary()

BackendSource = Backend | Callable[[], Backend] | None

# The bridge's page-store policy unless `pool_options` says otherwise (docs/allocator.md):
# two spares (room for the front of SGLang's free list mapped ahead); one more may stay
# mapped for 50 ms (a few scheduler steps: a page a finish empties and the next admission
# refills is not unmapped and mapped again), any beyond it is unmapped at once; and a
# background mapper, which maps ahead the pages of SGLang's next rows but at most one page
# not in use (more would be mapped for nothing when a fill stops).
DEFAULT_POOL_OPTIONS: dict[str, Any] = {
    "max_spare_pages": 2,
    "unmap_grace_s": 0.05,
    "grace_pages": 1,
    "map_ahead": True,
    "ahead_rows": AHEAD_ROWS,
    "ahead_pages": AHEAD_PAGES,
    "warm_compaction": True,  # compact.warm_up at attach (a device pool)
}


class Bridge:
    """The state of one pool's bridge. `active` is False when the native buffers stayed;
    `reason` then says why."""

    def __init__(self, pool: Any, ledger: Ledger, *, pool_name: str, reason: str) -> None:
        self._pool = weakref.ref(pool)  # the registry keys on the pool: no strong cycle
        self.ledger = ledger
        self.pool_name = pool_name
        self.reason = reason
        self.active = False
        self.facts: SwaFacts | None = None
        self.backend: Backend | None = None
        self.owns_backend = False
        self.store: PageStore | None = None
        self.tensors: list[Any] = []  # the VMM views now in SGLang's kv_buffer
        self.follower: RowFollower | None = None
        self.mapper: BackgroundMapper | None = None
        self.hooks: AllocatorHooks | None = None  # the six methods shadowed on SGLang's allocator
        self.policy: FrontPolicy | None = None  # the journal replayed, the front kept mapped
        self.swa_account: Account | None = None
        self.runtime_accounts: list[Account] = []
        self.swa_owner: Any = None  # SGLang's SWATokenToKVPoolAllocator (the index mapping)
        self.rows_moved = 0  # rows moved by compaction
        self.compactions_deferred = 0  # compactions that moved nothing: ids still being read
        self.compaction_warmed = False  # compact.warm_up ran its kernels at attach
        self._store_left_open = False  # a detach's store close raised: the next detach retries

    @property
    def pool(self) -> Any:
        """The SGLang pool, or None once it has been garbage-collected."""
        return self._pool()

    # -- views ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The page store's stats plus the follower's and the policy's (empty when not active):
        `held_pages` (engine pages held), `divergences`, `takes` and `give_backs` (calls
        that moved pages), `waited_allocs` (takes that mapped on the spot, waiting on the
        driver), `readback_waits` (CUDA: reads of freed ids that waited for their copy),
        `resyncs` (times the free-list mirror was re-read), `replays` and `forced_replays`
        (journal replays, and those an allocation past the pinned rows forced: docs/allocator.md),
        and the store's `pages_mapped_total` / `pages_unmapped_total` and
        `driver_failures`. Replays the journal first (without waiting for reads in flight)."""
        if self.store is None or self.follower is None or self.policy is None:
            return {}
        policy = self.policy
        policy.flush(wait=False)
        f = self.follower
        return {
            **self.store.stats(),
            "held_pages": f.held_rows,
            "divergences": f.divergences,
            "takes": f.takes,
            "give_backs": f.give_backs,
            "waited_allocs": f.waited,
            "readback_waits": int(policy.reader.waits),
            "resyncs": policy.resyncs,
            "replays": policy.flushes,
            "forced_replays": policy.forced,
            "rows_moved": self.rows_moved,
            "compactions_deferred": self.compactions_deferred,
            "compaction_warmed": int(self.compaction_warmed),
        }

    def compact(self, max_moves: int | None = None) -> int:
        """Move held SWA rows out of sparse VMM pages so those pages unmap; returns the rows
        moved. Only where no batch holds translated SWA ids: see `compact`'s docstring and
        docs/allocator.md#compaction. 0 when not active."""
        if not self.active or self.policy is None:
            return 0
        from kvledger.engines.sglang.bridge.compact import MAX_MOVES, compact

        return compact(self, max_moves=MAX_MOVES if max_moves is None else max_moves)

    def flush(self) -> None:
        """Bring the follower (hence the ledger) up to what SGLang's allocator did: replay the
        journal the hooks recorded, waiting for freed ids still being read (no-op when not
        active)."""
        if self.policy is not None and self.active:
            self.policy.flush(wait=True)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Give back the freed pages whose ids are known and wait until the background mapper
        has done what it can (mapped ahead, waited for fences, unmapped spares past their
        grace). For tests and benchmarks; True when idle within `timeout`."""
        if self.policy is not None:
            self.policy.settle()
        return self.mapper.wait_idle(timeout) if self.mapper is not None else True

    def physical_bytes(self) -> int:
        """The backend's device truth (host: memfd blocks), for accounting.reconcile."""
        if self.backend is None or not hasattr(self.backend, "physical_bytes"):
            raise RuntimeError("bridge has no backend with a physical_bytes reader")
        return int(self.backend.physical_bytes())

    def quiescent(self) -> Any:
        """A context manager during which the store has no driver call in flight (its lock
        held): for the truth reader, so the ledger and the backend are read at one instant
        (`accounting.reconcile.host_memfd_truth(bridge.physical_bytes, bridge.quiescent)`)."""
        if self.store is None:
            return contextlib.nullcontext()
        return self.store.quiescent()

    # -- teardown -----------------------------------------------------------------------------
    def detach(self) -> None:
        """Restore SGLang's own SWA buffers (live rows copied back), release everything the
        bridge mapped and remove the accounts `attach` registered. Idempotent. A detach that
        raised (the copy back, or its store's close) raises that cause, not a consequence; an
        account the ledger then refuses (its store still attached) stays held, and the next
        detach closes what is left and removes it."""
        pool = self.pool
        if pool is not None and _BRIDGES.get(pool) is self:
            del _BRIDGES[pool]
        try:
            if self.active:
                self._deactivate()
            elif self._store_left_open:
                self._close_store()
        except BaseException:
            self._remove_accounts(raising=False)
            raise
        self._remove_accounts(raising=True)

    def _remove_accounts(self, *, raising: bool) -> None:
        """Remove the accounts `attach` registered. One the ledger refuses stays held for the
        next detach; the refusal is raised with `raising`, else logged (an error is already
        on its way and must not be hidden by this one)."""
        held = [*self.runtime_accounts]
        if self.swa_account is not None:
            held.append(self.swa_account)
        kept: list[Account] = []
        refused: LedgerError | None = None
        for account in held:
            try:
                self.ledger.remove_account(account)
            except LedgerError as e:
                kept.append(account)
                refused = refused or e
        swa = self.swa_account
        self.runtime_accounts = [a for a in kept if a is not swa]
        if swa is not None and not any(a is swa for a in kept):
            self.swa_account = None
        if refused is not None:
            if raising:
                raise refused
            log.warning(
                "kvledger: detach of %s kept %d account(s) the ledger refused: %s",
                self.pool_name,
                len(kept),
                refused,
            )

    def _deactivate(self) -> None:
        self.active = False
        if self.hooks is not None:
            self.hooks.remove()
        assert self.store is not None and self.follower is not None and self.facts is not None
        pool = self.pool
        try:
            if pool is not None:  # else the pool and its views of the VMM range are gone
                native = native_copy(self.tensors, self.follower, self.facts)
                bufs = pool.swa_kv_pool.kv_buffer
                for i, t in enumerate(native):
                    bufs[i] = t
        finally:
            self.tensors = []
            self._close_store()

    def _close_store(self) -> None:
        """Close the store, then the backend the bridge owns. A close that raises leaves the
        backend open and `_store_left_open` set, for the next detach to try again."""
        assert self.store is not None
        self._store_left_open = True
        self.store.close()
        self._store_left_open = False
        if self.owns_backend and self.backend is not None:
            self.backend.close()

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def attach(
    pool: Any,
    ledger: Ledger,
    *,
    allocator: Any,
    backend: BackendSource = None,
    require: bool | None = None,
    env: Mapping[str, str] | None = None,
    pool_name: str = "dsv4",
    pool_options: Mapping[str, Any] | None = None,
) -> Bridge:
    """Register `pool` with `ledger` and, when `KVLEDGER_SGLANG_DSV4_BRIDGE=1`, move its SWA
    KV buffers onto a kvledger VMM pool driven by `allocator` (SGLang's
    SWATokenToKVPoolAllocator, or DeepSeek-V4's HiSparse wrapper of one).

    `backend`: a Backend, a factory of one, or None for the host backend on CPU pools and
    the CUDA backend on CUDA pools. `require` (default: KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE)
    makes an incompatible pool raise `IncompatibleError` instead of staying native with a
    warning. Attaching a pool twice returns the first bridge and changes nothing.
    """
    existing = _BRIDGES.get(pool)
    if existing is not None:
        return existing
    activation = BridgeActivation.from_env(env, require=require)
    bridge = Bridge(pool, ledger, pool_name=pool_name, reason="")
    if not activation.enabled:
        bridge.reason = f"bridge off (set {BRIDGE_ENABLE}=1)"
        _register_native(bridge)
        _BRIDGES[pool] = bridge
        return bridge

    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    swa_alloc = _swa_sub_allocator(allocator)
    facts = read_facts(pool, swa_alloc, dsv4_pool_class=DeepSeekV4TokenToKVPool)
    bridge.facts = facts
    reasons = pool_reasons(facts)
    get_kvcache = getattr(allocator, "get_kvcache", None)  # SGLang's public accessor
    if not reasons and get_kvcache is not None and get_kvcache() is not pool:
        reasons.append("the allocator serves another pool, expected the one being attached")
    if not reasons and swa_alloc is None:
        reasons.append(
            f"allocator {type(allocator).__name__} has no paged SWA side "
            "(swa_attn_allocator), expected SGLang's SWATokenToKVPoolAllocator"
        )
    device = _device_kind(facts)
    bridge.swa_owner = getattr(allocator, "logical_attn_allocator", allocator)
    be, owns = None, False
    if not reasons:
        try:
            be, owns = _make_backend(backend, device)
        except Exception as e:
            reasons.append(f"no VMM backend: {type(e).__name__}: {e}")
    if be is not None and not reasons:
        reasons += incompatibilities(facts, granularity=be.granularity, backend_device=device)
    if reasons:
        if owns and be is not None:
            be.close()
        return _refuse(bridge, activation, "; ".join(reasons))
    assert be is not None and swa_alloc is not None
    try:
        _activate(bridge, be, owns, swa_alloc, pool_options or {})
    except BaseException:
        if owns:
            be.close()
        raise
    _BRIDGES[pool] = bridge
    return bridge


def detach(pool: Any) -> None:
    """Detach whatever bridge `pool` has (no-op when none)."""
    bridge = _BRIDGES.get(pool)
    if bridge is not None:
        bridge.detach()


def bridge_of(pool: Any) -> Bridge | None:
    return _BRIDGES.get(pool)


# -- pieces ------------------------------------------------------------------------------------
def _swa_sub_allocator(allocator: Any) -> Any:
    if allocator is None:
        return None
    inner = getattr(allocator, "logical_attn_allocator", allocator)  # DSV4 HiSparse wrapper
    if getattr(inner, "swa_req_ring", False):
        return None
    return getattr(inner, "swa_attn_allocator", None)


def _device_kind(facts: SwaFacts) -> str:
    kinds = {d.split(":")[0] for d in facts.devices}
    return kinds.pop() if len(kinds) == 1 else "cpu"


def _make_backend(source: BackendSource, device: str) -> tuple[Backend, bool]:
    if source is None:
        if device == "cuda":
            import torch

            from allocator.cuda import CudaBackend

            return CudaBackend(torch.cuda.current_device()), True
        from allocator.host import HostBackend

        return HostBackend(), True
    if callable(source) and not hasattr(source, "reserve"):
        return source(), True
    return source, False  # type: ignore[return-value]


def _refuse(bridge: Bridge, activation: BridgeActivation, reason: str) -> Bridge:
    if activation.require:
        raise IncompatibleError(
            f"kvledger SGLang DSV4 bridge required ({BRIDGE_REQUIRE}=1) but unusable: {reason}"
        )
    log.warning("kvledger: SGLang DSV4 SWA buffers stay native: %s", reason)
    bridge.reason = reason
    _register_native(bridge)
    _BRIDGES[bridge.pool] = bridge
    return bridge


def _activate(
    bridge: Bridge, be: Backend, owns: bool, swa_alloc: Any, pool_options: Mapping[str, Any]
) -> None:
    """Register, map, copy, swap and hook; a failure at any step undoes the steps before it."""

    facts = bridge.facts
    assert facts is not None
    pool, ledger = bridge.pool, bridge.ledger
    options = {**DEFAULT_POOL_OPTIONS, **pool_options}
    map_ahead = bool(options.pop("map_ahead"))
    ahead_rows = int(options.pop("ahead_rows"))
    ahead_pages = options.pop("ahead_pages")
    warm = bool(options.pop("warm_compaction"))
    layout = SlotLayout(
        capacity_slots=facts.rows,
        slot_bytes=facts.row_bytes,
        page_bytes=be.granularity,
        slots_per_row=1,
    )
    with contextlib.ExitStack() as undo:
        runtime = registry.register_runtime(
            pool, ledger, pool_name=bridge.pool_name, exclude=(FAMILY,)
        )
        for acc in runtime:
            undo.callback(ledger.remove_account, acc)
        account = ledger.add_account(
            swa_specs(pool, facts, pool_name=bridge.pool_name, layout=layout),
            page_bytes=layout.page_bytes,
            capacity_slots=facts.rows * facts.page_tokens,
            slots_per_count=facts.page_tokens,  # the follower counts rows, the ledger tokens
        )
        undo.callback(ledger.remove_account, account)
        store = PageStore(
            be,
            layers=facts.layers,
            page_bytes=layout.page_bytes,
            num_pages=layout.num_pages,
            observer=account,
            name=f"{bridge.pool_name}/{FAMILY}",
            **options,
        )
        undo.callback(store.close)  # runs before the account's removal: LIFO
        follower = RowFollower(store, rows=facts.rows, row_bytes=facts.row_bytes, name=store.name)
        policy = FrontPolicy(
            swa_alloc,
            follower,
            reader=reader_for(facts.devices[0]),
            ahead_rows=ahead_rows if map_ahead else 0,
            ahead_pages=ahead_pages,
        )
        hooks = AllocatorHooks(swa_alloc, policy)
        live = policy.held_by_engine()
        follower.take(live)
        bufs = pool.swa_kv_pool.kv_buffer
        native = list(bufs)
        vmm = [
            store.byte_tensor(i, layout.buffer_bytes).view(facts.rows, facts.row_bytes)
            for i in range(facts.layers)
        ]
        for i, t in enumerate(vmm):
            for row in [0, *live]:
                t[row].copy_(native[i][row])
        undo.callback(bufs.__setitem__, slice(None), native)  # SGLang's tensors back
        for i, t in enumerate(vmm):
            bufs[i] = t
        undo.callback(hooks.remove)
        hooks.install()
        # On CUDA the mapper always runs: it is the thread that waits for the fences of
        # freed pages (a device synchronisation) before unmapping them (readback).
        cuda = facts.devices[0].startswith("cuda")
        mapper = BackgroundMapper(store, on_idle=policy.idle_flush) if map_ahead or cuda else None
        undo.pop_all()  # every step done: keep them
    bridge.backend, bridge.owns_backend = be, owns
    bridge.store, bridge.tensors, bridge.follower = store, vmm, follower
    bridge.hooks, bridge.policy, bridge.mapper = hooks, policy, mapper
    bridge.swa_account = account
    bridge.runtime_accounts = runtime
    bridge.active = True
    bridge.reason = ""
    if warm:
        from kvledger.engines.sglang.bridge.compact import warm_up

        try:
            bridge.compaction_warmed = warm_up(bridge)
        except Exception as e:  # only the first compaction's time is at stake
            log.warning("kvledger: SGLang DSV4 bridge: compaction warm-up failed: %s", e)


def _register_native(bridge: Bridge) -> None:
    bridge.runtime_accounts = registry.register_runtime(
        bridge.pool, bridge.ledger, pool_name=bridge.pool_name, exclude=()
    )
