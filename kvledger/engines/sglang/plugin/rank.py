"""One SGLang process's kvledger: a ledger with SGLang's labels, its runners' pools, device
truth and a publisher.

    rank = RankLedger(labels, directory=..., interval=1.0)
    rank.add_runner(model_runner)   # once per ModelRunner that built pools (target, drafts)
    rank.rebaseline("after CUDA graph capture")
    rank.refresh_runner(model_runner)  # after post_capture_resize_kv_pool: figures follow
    rank.close()                    # idempotent: publisher stopped, its file removed,
                                    # bridges detached, accounts removed

The target runner's pool is registered as `<kind>` (`dsv4`, `hybrid_linear`, `mha`, `swa`,
`kv`, or
`unknown` for a pool the inventory does not know), a draft runner's as
`draft<idx>_<kind>`. A DeepSeek-V4 target pool goes through
`kvledger.engines.sglang.bridge.attach`, which keeps its SWA buffers native unless
`KVLEDGER_SGLANG_DSV4_BRIDGE=1` (and raises with `..._REQUIRE=1` when it cannot bridge).
The first pool on a CUDA device also gets NVML truth, its baseline taken before the
bridge maps anything, split into the GPU's parts (`accounting.gpu_parts`): the runners'
models are the weights (each storage once over all runners), torch's caching allocator is
read by pool with SGLang's VMM arenas named (`kvledger.engines.sglang.vmm_owner`). A bridged CPU
pool (host backend) gets the memfd truth.

SGLang's own KV figure: after every publish each registered pool's `mem_usage` (what
SGLang 0.5.23 reads for `sglang:kv_cache_memory_usage_gb`, `/get_server_info` and
`/v1/loads`) is set to the physical bytes kvledger accounts for it, in SGLang's GB
(bytes / 2^30), unless `KVLEDGER_SGLANG_NATIVE_MEM_USAGE=1` (`kvledger.engines.sglang.mem_usage`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.ledger import Account, Ledger
from accounting.publisher import Publisher
from accounting.snapshot import Snapshot
from kvledger.engines.sglang import mem_usage, vmm_owner
from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.engines.sglang.inventory import UNKNOWN, pool_kind, register_pool, unregister

log = logging.getLogger(__name__)


@dataclass
class PoolRecord:
    """What was registered for one runner's pool."""

    name: str
    kind: str
    pool_class: str
    device: str
    pool: Callable[[], Any]  # a weak reference: the ledger does not keep SGLang's pool alive
    accounts: list[Account] = field(default_factory=list)
    bridge: Any = None  # kvledger.engines.sglang.bridge.Bridge for a DeepSeek-V4 target pool
    model: Callable[[], Any] | None = None  # a weak reference to the runner's model
    native_mem_usage: Any = None  # the pool's own mem_usage before kvledger set it

    @property
    def bridged(self) -> bool:
        return bool(self.bridge is not None and self.bridge.active)


class RankLedger:
    def __init__(
        self,
        labels: Mapping[str, str],
        *,
        directory: str,
        interval: float = 1.0,
        bridge_env: Mapping[str, str] | None = None,
        mem_usage_env: Mapping[str, str] | None = None,
    ) -> None:
        self.ledger = Ledger(labels)
        self.fix_mem_usage = mem_usage.enabled(mem_usage_env)
        self.weights_bytes = 0  # the runners' models, each storage once (on the truth's device)
        self.directory = directory
        self.interval = interval
        self.bridge_env = bridge_env
        self.pools: dict[str, PoolRecord] = {}
        # The production compaction policy (kvledger.engines.sglang.bridge.compact_policy), for
        # every bridged pool of this process; off with KVLEDGER_SGLANG_DSV4_COMPACT=0.
        self.compaction = CompactionPolicy.from_env(bridge_env)
        self.truth: Any = None
        self.publisher: Publisher | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.holders: Any = (
            None  # kvledger.engines.sglang.holders.HolderReader, once a scheduler is seen
        )

    # -- pools ----------------------------------------------------------------------------
    def add_runner(self, runner: Any) -> PoolRecord:
        """Register the pools `runner` (an SGLang ModelRunner) has just built; start publishing."""
        pool = runner.token_to_kv_pool
        allocator = getattr(runner, "token_to_kv_pool_allocator", None)
        draft = bool(getattr(runner, "is_draft_worker", False))
        with self._lock:
            if self._closed:
                raise RuntimeError("RankLedger is closed")
            try:
                kind = pool_kind(pool)
            except ValueError:
                kind = UNKNOWN
            name = kind
            if draft:
                idx = getattr(runner, "draft_model_idx", None)
                name = f"draft{idx if idx is not None else ''}_{kind}"
            old = self.pools.get(name)
            if old is not None:
                if old.pool() is pool:
                    return old  # the same pool reported again: nothing changes
                # The runner rebuilt its pool (a resize, a role switch): the old one is gone.
                if self.holders is not None and not name.startswith("draft"):
                    self.holders.close()
                    self.holders = None
                del self.pools[name]
                self._release(old)
            device = _device_of(pool)
            record = PoolRecord(name, kind, type(pool).__name__, device, weakref.ref(pool))
            record.model = _weak(getattr(runner, "model", None))
            self.pools[name] = record
            try:
                self._count_weights()
                if device.startswith("cuda") and self.truth is None:
                    self._add_nvml_truth(device, pool)
                self._register(record, pool, allocator, draft)
            except BaseException:
                del self.pools[name]
                self._count_weights()
                raise
            if self.publisher is None:
                self.publisher = _RankPublisher(
                    self.ledger, self.directory, interval=self.interval, after=self._published
                )
            else:
                self.publisher.publish()
            return record

    def _register(self, record: PoolRecord, pool: Any, allocator: Any, draft: bool) -> None:
        if record.kind == "dsv4" and not draft:
            self._attach_dsv4(record, pool, allocator)
            return
        inv = register_pool(self.ledger, pool, name=record.name, allow_unknown=True)
        record.accounts = list(inv.accounts)
        if record.kind == UNKNOWN:
            log.warning(
                "kvledger: pool %s (%s) is not one the inventory knows; its %d storages "
                "(%d bytes) are published as family 'unknown'",
                record.name,
                type(pool).__name__,
                len(inv.specs),
                inv.storage_bytes,
            )

    def refresh_runner(self, runner: Any) -> PoolRecord | None:
        """Register `runner`'s pool anew (after `post_capture_resize_kv_pool` backed its final
        span and set its size): the old accounts go, the figures are read again. None for a
        pool that was never registered."""
        pool = getattr(runner, "token_to_kv_pool", None)
        with self._lock:
            if self._closed:
                return None
            old = next((r for r in self.pools.values() if r.pool() is pool), None)
            if old is None:
                return None
            del self.pools[old.name]
            self._release(old)
        return self.add_runner(runner)

    def _count_weights(self) -> None:
        from accounting.torch_memory import weight_bytes

        models = [m for r in self.pools.values() if r.model is not None and (m := r.model())]
        device = self.truth_device
        try:
            self.weights_bytes = weight_bytes(models, device) if device else 0
        except Exception as e:  # a model of a shape torch does not walk: no weights figure
            log.warning(
                "kvledger: counting the model's weights failed: %s: %s", type(e).__name__, e
            )

    @property
    def truth_device(self) -> str | None:
        """The CUDA device the GPU parts are about (the first CUDA pool's), or None."""
        for r in self.pools.values():
            if r.device.startswith("cuda"):
                return r.device
        return None

    def _published(self, snap: Snapshot) -> None:
        """After every publish: SGLang's own `mem_usage` of each registered pool."""
        if not self.fix_mem_usage:
            return
        by_pool = snap.rollup("pool")
        for record in list(self.pools.values()):
            pool = record.pool()
            if pool is None or record.kind == UNKNOWN:
                continue
            if record.native_mem_usage is None:
                record.native_mem_usage = (getattr(pool, "mem_usage", None),)
            names = {record.name}
            if record.bridge is not None:
                names.add(getattr(record.bridge, "pool_name", record.name))
            physical = sum(by_pool.get((n,), {}).get("physical_bytes", 0) for n in names)
            mem_usage.write(pool, physical)

    def _attach_dsv4(self, record: PoolRecord, pool: Any, allocator: Any) -> None:
        from kvledger.engines.sglang.bridge import attach

        bridge = attach(
            pool, self.ledger, allocator=allocator, env=self.bridge_env, pool_name=record.name
        )
        record.bridge = bridge
        if bridge.active and not record.device.startswith("cuda"):
            from accounting.reconcile import host_memfd_truth

            self.ledger.add_truth(host_memfd_truth(bridge.physical_bytes, bridge.quiescent))

    def _add_nvml_truth(self, device: str, pool: Any) -> None:
        import torch

        from accounting.nvml import NvmlTruth
        from accounting.torch_memory import CudaTorchMemory

        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        torch.cuda.synchronize(index)

        def arenas() -> list[tuple[int, int]]:
            return [
                a
                for r in self.pools.values()
                if (p := r.pool()) is not None
                for a in vmm_owner.arena_pool_ids(p)
            ]

        torch_memory = CudaTorchMemory(index, arena_pools=arenas, graph_pools=_graph_pools)
        self.truth = NvmlTruth(
            index,
            torch_memory=torch_memory,
            weights=lambda: self.weights_bytes,
            # SGLang's VMM-backed buffers are already backed when their pool is built
            vmm_at_baseline=vmm_owner.backed_bytes(pool),
        )
        self.ledger.add_truth(self.truth)

    def rebaseline(self, point: str) -> int | None:
        """Name the memory the process holds outside torch and the VMM pools so far (NVML
        truth only); returns those bytes, None without NVML truth."""
        if self.truth is None or self._closed:
            return None
        import torch

        torch.cuda.synchronize(self.truth.device)
        got = self.truth.rebaseline(self.ledger.snapshot(reconcile=False), point)
        if self.publisher is not None:
            self.publisher.publish()
        return got

    def compact_step(self) -> int:
        """One compaction step for each bridged pool (the scheduler's hooks call it with no
        batch in flight); returns the rows moved."""
        if not self.compaction.enabled or self._closed:
            return 0
        moved = 0
        for record in list(self.pools.values()):
            if record.bridged:
                moved += self.compaction.step(record.bridge)
        return moved

    # -- holders ---------------------------------------------------------------------------
    def attach_scheduler(self, scheduler: Any) -> Any:
        """Read who holds the target pool's slots from `scheduler` (an SGLang Scheduler):
        its tree cache, allocator, request pool and running batch
        (`kvledger.engines.sglang.holders.HolderReader`). Returns the reader, None without a
        target pool. A second call replaces the first reader."""
        from kvledger.engines.sglang.holders import GENERIC_UNITS, HolderReader, dsv4_units

        with self._lock:
            if self._closed:
                return None
            record = next((r for r in self.pools.values() if not r.name.startswith("draft")), None)
            if record is None:
                return None
            pool = record.pool()
            if self.holders is not None:
                self.holders.close()
                self.holders = None
            accounts: dict[str, list[Any]] = {}
            for a in self.ledger.accounts():
                if a.pool == record.name:
                    accounts.setdefault(a.family, []).append(a)
            units = dsv4_units(pool) if record.kind == "dsv4" else GENERIC_UNITS
            # Families whose slots an attached allocator reports (the bridge's SWA family);
            # the reader sets the others' from SGLang's counts.
            bridged = {f for f, accs in accounts.items() if any(a.reported for a in accs)}

            def running() -> Any:
                batch = getattr(scheduler, "running_batch", None)
                return list(getattr(batch, "reqs", None) or ())

            self.holders = HolderReader(
                self.ledger,
                accounts,
                tree=getattr(scheduler, "tree_cache", None),
                allocator=scheduler.token_to_kv_pool_allocator,
                req_to_token=getattr(scheduler, "req_to_token_pool", None),
                units=units,
                bridged=bridged,
                running=running,
                sync=record.bridge.flush if record.bridged else None,
            )
            return self.holders

    # -- lifetime --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, release_pools: bool = True) -> None:
        """Stop publishing (the file goes); with `release_pools`, also detach bridges (SGLang's
        own buffers back) and remove the accounts. Idempotent. A scheduler that is exiting
        passes release_pools=False: its pools go with the process, and copying the SWA rows
        back to native tensors then would only cost time and memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            publisher, self.publisher = self.publisher, None
            holders, self.holders = self.holders, None
        if holders is not None:
            holders.close()
        try:
            if publisher is not None:
                publisher.close()
        finally:
            if release_pools:
                self._release_pools()

    def _release_pools(self) -> None:
        for record in reversed(list(self.pools.values())):
            self._release(record)
        self.pools.clear()

    def _release(self, record: PoolRecord) -> None:
        try:
            if record.bridge is not None:
                record.bridge.detach()
            unregister(self.ledger, record.accounts)
            pool = record.pool()
            if record.native_mem_usage is not None and pool is not None:
                pool.mem_usage = record.native_mem_usage[0]  # SGLang's own figure back
        except Exception as e:
            log.warning(
                "kvledger: releasing pool %s failed: %s: %s", record.name, type(e).__name__, e
            )

    def __enter__(self) -> RankLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RankPublisher(Publisher):
    """The publisher, and `after(snapshot)` once each publish is written (a failure there is
    logged, never a failed publish)."""

    def __init__(self, *args: Any, after: Callable[[Snapshot], None], **kw: Any) -> None:
        self._after = after  # set before the first publish, which Publisher.__init__ does
        super().__init__(*args, **kw)

    def publish(self) -> Snapshot:
        snap = super().publish()
        try:
            self._after(snap)
        except Exception as e:
            log.warning("kvledger: after publishing: %s: %s", type(e).__name__, e)
        return snap


def _graph_pools() -> list[tuple[int, int]]:
    """SGLang's global CUDA graph memory pool (`graph_pool_handle()`, shared by its graph
    runners: `sglang/srt/model_executor/runner_utils/pool.py`), once it exists."""
    try:
        from sglang.srt.model_executor.runner_utils.pool import get_global_graph_memory_pool

        handle = get_global_graph_memory_pool()
    except Exception:  # not SGLang 0.5.23's layout: graphs captured without pool= still count
        return []
    if isinstance(handle, tuple) and len(handle) == 2:
        return [(int(handle[0]), int(handle[1]))]
    return []


def _weak(obj: Any) -> Callable[[], Any] | None:
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _device_of(pool: Any) -> str:
    dev = getattr(pool, "device", None)
    if dev is None:
        return "cpu"
    text = str(dev)
    if text == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return text
