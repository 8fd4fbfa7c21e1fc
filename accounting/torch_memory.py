"""torch's side of the GPU parts (accounting.gpu_parts): the caching allocator's segments
split by pool, and the bytes of a model's parameters and buffers.

Pool ids (torch's `MempoolId_t`, a pair): `(0, 0)` is the default pool; the pool a
graph capture makes for itself (`torch.cuda.graph(g)` without `pool=`) has a non-zero
first element; `torch.cuda.graph_pool_handle()` and a user `torch.cuda.MemPool` are
`(0, n)`, which torch does not tell apart, so a handle shared by several captures
(SGLang's global graph memory pool) is named by the caller (`graph_pools`). A user pool
whose segments come from a VMM reservation (SGLang's `KvVmmArena`) is named too
(`arena_pools`): torch counts its segments at their virtual extent.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from accounting.gpu_parts import TorchMemory

PoolId = tuple[int, int]
DEFAULT_POOL: PoolId = (0, 0)


def is_graph_pool(pool: PoolId, graph_pools: Iterable[PoolId] = ()) -> bool:
    return (pool[0] != 0) or pool in set(graph_pools)


def torch_memory_of(
    segments: Sequence[Mapping[str, Any]],
    *,
    reserved_bytes: int,
    allocated_bytes: int,
    arena_pools: Iterable[PoolId] = (),
    graph_pools: Iterable[PoolId] = (),
) -> TorchMemory:
    """A `TorchMemory` from `torch.cuda.memory_snapshot()`'s segments (each with
    `segment_pool_id`, `total_size`, `allocated_size`) and the allocator's totals."""
    arenas, graphs = set(map(tuple, arena_pools)), set(map(tuple, graph_pools))
    g_res = g_alloc = a_res = a_alloc = 0
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id") or DEFAULT_POOL)
        total, used = int(seg["total_size"]), int(seg["allocated_size"])
        if pool in arenas:
            a_res += total
            a_alloc += used
        elif is_graph_pool(pool, graphs):  # type: ignore[arg-type]
            g_res += total
            g_alloc += used
    return TorchMemory(
        reserved_bytes=reserved_bytes,
        allocated_bytes=allocated_bytes,
        graph_reserved_bytes=g_res,
        graph_allocated_bytes=g_alloc,
        arena_reserved_bytes=a_res,
        arena_allocated_bytes=a_alloc,
    )


def cuda_torch_memory(
    device: int, *, arena_pools: Iterable[PoolId] = (), graph_pools: Iterable[PoolId] = ()
) -> TorchMemory:
    """torch's caching allocator on CUDA device `device` now."""
    import torch

    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device") == device]
    return torch_memory_of(
        segments,
        reserved_bytes=int(torch.cuda.memory_reserved(device)),
        allocated_bytes=int(torch.cuda.memory_allocated(device)),
        arena_pools=arena_pools,
        graph_pools=graph_pools,
    )


class CudaTorchMemory:
    """`cuda_torch_memory` for a truth reader that reads it at every publish, without walking
    torch's segment list each time: `memory_snapshot()` lists every block of every segment,
    which in a large server costs milliseconds on the thread that publishes (the engine's).
    The split by pool is taken again when torch's reserved bytes or segment count move (a
    segment made or returned), when the named pools change, or `max_age` seconds after the
    last walk; between walks the totals are live and the graph and arena figures are the
    last walk's. A capture that reuses a graph pool's free blocks moves bytes between
    `activations` and `allocator_slack` until the next walk; no other part moves."""

    def __init__(
        self,
        device: int,
        *,
        arena_pools: Callable[[], Iterable[PoolId]] = tuple,
        graph_pools: Callable[[], Iterable[PoolId]] = tuple,
        max_age: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self._arena_pools = arena_pools
        self._graph_pools = graph_pools
        self.max_age = max_age
        self._clock = clock
        self._key: tuple[Any, ...] | None = None
        self._split: TorchMemory | None = None
        self._walked_at = 0.0
        self.walks = 0

    def __call__(self) -> TorchMemory:
        import torch

        stats = torch.cuda.memory_stats(self.device)
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        arenas, graphs = tuple(self._arena_pools()), tuple(self._graph_pools())
        key = (reserved, int(stats.get("segment.all.current", 0)), arenas, graphs)
        now = self._clock()
        if self._split is None or key != self._key or now - self._walked_at >= self.max_age:
            self._split = cuda_torch_memory(self.device, arena_pools=arenas, graph_pools=graphs)
            self._key, self._walked_at = key, now
            self.walks += 1
            return self._split
        return dataclasses.replace(self._split, reserved_bytes=reserved, allocated_bytes=allocated)


def weight_bytes(modules: Iterable[Any], device: Any = None) -> int:
    """Bytes of the parameters and buffers of `modules` (torch.nn.Module), each storage
    counted once however many tensors or modules share it; with `device` (a torch.device
    or its string), only storages on that device."""
    import torch

    want = torch.device(device) if device is not None else None
    seen: dict[tuple[str, int], int] = {}
    for module in modules:
        tensors = [*module.parameters(), *module.buffers()]
        for t in tensors:
            if t is None:
                continue
            if want is not None and not _same_device(t.device, want):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), int(storage.data_ptr()))
            if storage.data_ptr() == 0:  # a meta or empty tensor holds nothing
                continue
            seen[key] = max(seen.get(key, 0), int(storage.nbytes()))
    return sum(seen.values())


def _same_device(a: Any, b: Any) -> bool:
    if a.type != b.type:
        return False
    return b.index is None or a.index == b.index
