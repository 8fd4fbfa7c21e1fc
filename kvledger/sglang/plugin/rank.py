"""One SGLang process's kvledger: a ledger with SGLang's labels, its runners' pools, device
truth and a publisher.

    rank = RankLedger(labels, directory=..., interval=1.0)
    rank.add_runner(model_runner)   # once per ModelRunner that built pools (target, drafts)
    rank.rebaseline("after CUDA graph capture")
    rank.close()                    # idempotent: publisher stopped, its file removed,
                                    # bridges detached, accounts removed

The target runner's pool is registered as `<kind>` (`dsv4`, `hybrid_linear`, `mha`, `swa`,
`kv`, or
`unknown` for a pool the inventory does not know), a draft runner's as
`draft<idx>_<kind>`. A DeepSeek-V4 target pool goes through
`kvledger.sglang.bridge.attach`, which keeps its SWA buffers native unless
`KVLEDGER_SGLANG_DSV4_BRIDGE=1` (and raises with `..._REQUIRE=1` when it cannot bridge).
The first pool on a CUDA device also gets NVML truth, its baseline taken before the
bridge maps anything; a bridged CPU pool (host backend) gets the memfd truth.
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
from kvledger.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.sglang.inventory import UNKNOWN, pool_kind, register_pool

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
    bridge: Any = None  # kvledger.sglang.bridge.Bridge for a DeepSeek-V4 target pool

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
    ) -> None:
        self.ledger = Ledger(labels)
        self.directory = directory
        self.interval = interval
        self.bridge_env = bridge_env
        self.pools: dict[str, PoolRecord] = {}
        # The production compaction policy (kvledger.sglang.bridge.compact_policy), for
        # every bridged pool of this process; off with KVLEDGER_SGLANG_DSV4_COMPACT=0.
        self.compaction = CompactionPolicy.from_env(bridge_env)
        self.truth: Any = None
        self.publisher: Publisher | None = None
        self._lock = threading.Lock()
        self._closed = False

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
                del self.pools[name]
                self._release(old)
            device = _device_of(pool)
            if device.startswith("cuda") and self.truth is None:
                self._add_nvml_truth(device)
            record = PoolRecord(name, kind, type(pool).__name__, device, weakref.ref(pool))
            if kind == "dsv4" and not draft:
                self._attach_dsv4(record, pool, allocator)
            else:
                inv = register_pool(self.ledger, pool, name=name, allow_unknown=True)
                record.accounts = list(inv.accounts)
                if kind == UNKNOWN:
                    log.warning(
                        "kvledger: pool %s (%s) is not one the inventory knows; its %d storages "
                        "(%d bytes) are published as family 'unknown'",
                        name,
                        type(pool).__name__,
                        len(inv.specs),
                        inv.storage_bytes,
                    )
            self.pools[name] = record
            if self.publisher is None:
                self.publisher = Publisher(self.ledger, self.directory, interval=self.interval)
            else:
                self.publisher.publish()
            return record

    def _attach_dsv4(self, record: PoolRecord, pool: Any, allocator: Any) -> None:
        from kvledger.sglang.bridge import attach

        bridge = attach(
            pool, self.ledger, allocator=allocator, env=self.bridge_env, pool_name=record.name
        )
        record.bridge = bridge
        if bridge.active and not record.device.startswith("cuda"):
            from accounting.reconcile import host_memfd_truth

            self.ledger.add_truth(host_memfd_truth(bridge.physical_bytes, bridge.quiescent))

    def _add_nvml_truth(self, device: str) -> None:
        import torch

        from accounting.nvml import NvmlTruth

        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        torch.cuda.synchronize(index)
        self.truth = NvmlTruth(index, torch_reserved=lambda: torch.cuda.memory_reserved(index))
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
            for account in record.accounts:
                self.ledger.remove_account(account)
        except Exception as e:
            log.warning(
                "kvledger: releasing pool %s failed: %s: %s", record.name, type(e).__name__, e
            )

    def __enter__(self) -> RankLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_of(pool: Any) -> str:
    dev = getattr(pool, "device", None)
    if dev is None:
        return "cpu"
    text = str(dev)
    if text == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return text
