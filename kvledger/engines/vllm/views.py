"""A vLLM source as the exporter reads it: per KV-cache group figures from a worker's or an
engine core's file (kvledger.engines.vllm publishes them; docs/vllm.md).

A vLLM 0.33 deployment publishes two kinds of file per engine, told apart by their
`engine_type` label (kvledger.engines.vllm.labels):

- `vllm_worker` (one per TP/PP rank): the bytes. Account `kv_pool` is the worker's one
  KV storage (tensor = reserved = physical, `capacity_slots` its blocks); account
  `g<i>_<kind>` per KV-cache group `i` holds one buffer per layer view of that group,
  which aliases the storage (no bytes of its own).
- `vllm_scheduler` (one per engine core, i.e. per DP rank): the occupancy in slots only.
  `kv_pool` blocks in use, `kv_pool_evictable` free blocks holding a cached prefix, and
  `g<i>_<kind>` each group's slots in use (its holders: cached or not), `evictable_g<i>_<kind>`
  the group's free cached blocks as its slots; the snapshot's `request_slots` part
  (accounting.request_slots) the running requests' slots per group.

`worker_view` and `engine_view` turn one such file into typed rows; the collector
exports them under `kvledger_vllm_*` (exporter.metrics) and /debug/kv shows them. A
worker's per-group layers and bytes need its buffer rows (one per layer): they are read
once per (source, epoch) and kept in `_WORKER_CACHE`, so a heartbeat that changes
nothing costs no parse. A family whose name is not `g<index>_<kind>` is not a group and
is left out of the group rows (its bytes are still on `kv_pool`).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accounting.request_slots import RequestSlots
from accounting.rows import AccountRow, BufferRow
from accounting.snapfile.summary import Summary

WORKER = (
    "vllm_worker"  # kvledger.engines.vllm.labels.WORKER (not imported: that package may be absent)
)
SCHEDULER = "vllm_scheduler"
ROLES = (WORKER, SCHEDULER)
POOL_FAMILY = "kv_pool"
EVICTABLE_FAMILY = "kv_pool_evictable"
# A worker's blocks backed now (vLLM 0.34's extensible KV cache: kvledger.engines.vllm.extensible)
COMMITTED_FAMILY = "kv_pool_committed"
GROUP_EVICTABLE_PREFIX = "evictable_"  # + a group's family: its free cached blocks as slots
# The labels vLLM's own metrics carry (vllm/v1/metrics/loggers.py), then a worker's ranks.
ENGINE_LABELS: tuple[str, ...] = ("model_name", "engine")
WORKER_LABELS: tuple[str, ...] = (*ENGINE_LABELS, "tp_rank", "pp_rank")
GROUP_LABELS: tuple[str, ...] = ("group", "kind")
_GROUP = re.compile(r"^g(\d{1,4})_([A-Za-z0-9_]{1,64})$")
# Bytes per element of the dtypes a KV view can have (torch's names without "torch.").
_ELEMENT_BYTES = {
    "float64": 8,
    "int64": 8,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int16": 2,
    "uint16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def role(labels: Mapping[str, str]) -> str | None:
    """`vllm_worker`, `vllm_scheduler`, or None for a source that is not vLLM's."""
    value = labels.get("engine_type")
    return value if value in ROLES else None


def _labels(labels: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    defaults = {"model_name": "unknown", "engine": "0", "tp_rank": "0", "pp_rank": "0"}
    return {k: str(labels.get(k) or defaults[k]) for k in names}


def engine_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """vLLM's labels of an engine: `model_name`, `engine`."""
    return _labels(labels, ENGINE_LABELS)


def worker_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """vLLM's labels of an engine plus the worker's `tp_rank`, `pp_rank`."""
    return _labels(labels, WORKER_LABELS)


def group_of(family: str) -> tuple[int, str] | None:
    """`g3_sliding_window` -> (3, "sliding_window"); None for a family that is not a group."""
    m = _GROUP.match(family)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class WorkerGroup:
    """One KV-cache group as one worker allocated it."""

    group: int
    kind: str  # vLLM's get_kv_cache_spec_kind, or "unknown"
    layers: int  # layer views in the group
    block_size: int  # slots per block: tokens (vLLM's block_size); 1 for a state group
    capacity_slots: int
    slot_bytes: int  # bytes one slot takes over all the group's layers (bytes per token)
    tensor_bytes: int  # numel * element_size of the group's views: the bytes it addresses
    reserved_bytes: int  # the storage its views lie in (aliased: shared by every group)
    physical_bytes: int  # device memory held for that storage (aliased as well)


@dataclass(frozen=True)
class WorkerView:
    """A worker's KV cache: its storage once, and every group's figures."""

    tensor_bytes: int
    reserved_bytes: int
    physical_bytes: int
    blocks: int
    block_bytes: int  # storage bytes per block id (all layers of all groups)
    groups: tuple[WorkerGroup, ...]
    # Blocks backed by device memory now: vLLM 0.34's extensible cache commits a prefix of
    # `blocks` (0 while released for sleep); every block of an ordinary storage is backed.
    committed_blocks: int = 0


@dataclass(frozen=True)
class EngineGroup:
    """One KV-cache group's occupancy in an engine core's block pool."""

    group: int
    kind: str
    slots_per_block: int
    capacity_slots: int
    occupied_slots: int
    evictable_slots: int  # the pool's evictable blocks as this group's slots
    free_slots: int  # the pool's free blocks as this group's slots
    # The group's slots by holder (accounting.figures' names): tree_protected, request_only
    # and unattributed split occupied_slots; tree_evictable is the group's own free cached
    # blocks as slots (0 where not read).
    held_slots: tuple[tuple[str, int], ...] = ()
    # Running requests' slots in this group (shared ones in each request that holds them):
    # their sum and per-bucket counts (accounting.request_slots.REQUEST_SLOTS_BUCKETS, the
    # last past every bound); None / () when the engine core published no footprints.
    request_slots_sum: int | None = None
    request_slots_counts: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """One of the running requests holding the most slots."""

    rid: str  # vLLM's request id (at most 128 printable characters)
    tokens: int  # tokens whose KV vLLM computed for it (num_computed_tokens)
    slots: tuple[int, ...]  # per group, in the order of the view's groups
    blocks: tuple[int, ...]  # the same in blocks (slots / the group's slots per block)


@dataclass(frozen=True)
class EngineView:
    """An engine core's block pool (shared by all groups) and each group's slots."""

    blocks: int  # num_gpu_blocks, the null block included
    occupied_blocks: int  # ref count > 0 (the null block included)
    evictable_blocks: int  # free blocks holding a cached prefix (reusable on a hit)
    free_blocks: int  # blocks - occupied_blocks; evictable ones among them
    groups: tuple[EngineGroup, ...]
    # Blocks holding KV by holder (accounting.figures' names): tree_protected, request_only
    # and unattributed split occupied_blocks; tree_evictable = evictable_blocks (free to vLLM).
    held_blocks: tuple[tuple[str, int], ...] = ()
    # Requests running when the engine core last read them; None: no footprints published.
    running_requests: int | None = None
    requests: tuple[EngineRequest, ...] = ()  # the largest (at most 20), largest first


def _accounts(summary: Summary) -> dict[str, AccountRow]:
    return {a.family: a for a in summary.accounts}


def element_bytes(dtype: str) -> int | None:
    return _ELEMENT_BYTES.get(dtype)


def _view_bytes(row: BufferRow) -> int:
    size = element_bytes(row.spec.dtype)
    if size is None or not row.spec.shape:
        return row.spec.slot_bytes * row.spec.capacity_slots
    return math.prod(row.spec.shape) * size


def worker_view(summary: Summary, buffers: Sequence[BufferRow]) -> WorkerView:
    """A worker's figures from its summary and its buffer rows."""
    accounts = _accounts(summary)
    pool = next((f.figures for f in summary.families if f.family == POOL_FAMILY), None)
    pool_acc = accounts.get(POOL_FAMILY)
    blocks = pool_acc.capacity_slots if pool_acc is not None else 0
    committed_acc = accounts.get(COMMITTED_FAMILY)
    tensor = pool.tensor_bytes if pool is not None else 0
    reserved = pool.reserved_bytes if pool is not None else 0
    physical = pool.physical_bytes if pool is not None else 0
    by_family: dict[str, list[BufferRow]] = {}
    for b in buffers:
        by_family.setdefault(b.spec.family, []).append(b)
    groups = []
    for family, acc in accounts.items():
        g = group_of(family)
        if g is None:
            continue
        rows = by_family.get(family, [])
        groups.append(
            WorkerGroup(
                group=g[0],
                kind=g[1],
                layers=len(rows),
                block_size=acc.capacity_slots // blocks if blocks else 0,
                capacity_slots=acc.capacity_slots,
                slot_bytes=sum(b.spec.slot_bytes for b in rows),
                tensor_bytes=sum(_view_bytes(b) for b in rows),
                reserved_bytes=reserved,
                physical_bytes=physical,
            )
        )
    groups.sort(key=lambda g: g.group)
    return WorkerView(
        tensor_bytes=tensor,
        reserved_bytes=reserved,
        physical_bytes=physical,
        blocks=blocks,
        # the pool's bytes per block id (= storage / blocks for an ordinary storage; the
        # VMM reservation's physical bytes follow its committed blocks, not all of them)
        block_bytes=pool_acc.slot_bytes if pool_acc is not None else 0,
        groups=tuple(groups),
        committed_blocks=committed_acc.occupied_slots if committed_acc is not None else blocks,
    )


def engine_view(summary: Summary) -> EngineView:
    """An engine core's figures, from its summary alone (its accounts carry slots only)."""
    accounts = _accounts(summary)
    pool = accounts.get(POOL_FAMILY)
    evictable = accounts.get(EVICTABLE_FAMILY)
    blocks = pool.capacity_slots if pool is not None else 0
    occupied = pool.occupied_slots if pool is not None else 0
    free = max(0, blocks - occupied)
    cached = min(evictable.occupied_slots, free) if evictable is not None else 0
    holders = {h.family: h.slots for h in summary.holders}
    part = summary.request_slots
    by_family = {f.family: f for f in part.families} if part is not None else {}
    groups = []
    for family, acc in accounts.items():
        g = group_of(family)
        if g is None:
            continue
        per_block = acc.capacity_slots // blocks if blocks else 0
        dist = by_family.get(family)
        groups.append(
            (
                family,
                EngineGroup(
                    group=g[0],
                    kind=g[1],
                    slots_per_block=per_block,
                    capacity_slots=acc.capacity_slots,
                    occupied_slots=acc.occupied_slots,
                    evictable_slots=cached * per_block,
                    free_slots=free * per_block,
                    held_slots=_group_held(family, holders, accounts),
                    request_slots_sum=dist.slots_sum if dist is not None else None,
                    request_slots_counts=dist.counts if dist is not None else (),
                ),
            )
        )
    groups.sort(key=lambda fg: fg[1].group)
    return EngineView(
        blocks,
        occupied,
        cached,
        free,
        tuple(g for _, g in groups),
        _held_blocks(summary),
        running_requests=part.running_requests if part is not None else None,
        requests=_requests(part, groups),
    )


def _group_held(
    family: str, holders: Mapping[str, Any], accounts: Mapping[str, AccountRow]
) -> tuple[tuple[str, int], ...]:
    """A group's slots by holder: its account's (slots in use), tree_evictable its
    `evictable_<family>` account's occupied slots (0 where there is none)."""
    held = holders.get(family)
    if held is None:
        return ()
    out = held.to_dict()
    evictable = accounts.get(GROUP_EVICTABLE_PREFIX + family)
    out["tree_evictable"] = evictable.occupied_slots if evictable is not None else 0
    return tuple(out.items())


def _requests(
    part: RequestSlots | None, groups: Sequence[tuple[str, EngineGroup]]
) -> tuple[EngineRequest, ...]:
    """The listed requests, their slots and blocks in the groups' order."""
    if part is None:
        return ()
    out = []
    for r in part.requests:
        slots = tuple(r.slots_by_family.get(f, 0) for f, _ in groups)
        blocks = tuple(
            s // g.slots_per_block if g.slots_per_block else 0
            for s, (_, g) in zip(slots, groups, strict=True)
        )
        out.append(EngineRequest(r.rid, r.tokens, slots, blocks))
    return tuple(out)


def _held_blocks(summary: Summary) -> tuple[tuple[str, int], ...]:
    """The pool's blocks by holder: `kv_pool`'s holders (its blocks in use) with the
    tree_evictable of `kv_pool_evictable` (free blocks holding a cached prefix)."""
    by = {h.family: h.slots for h in summary.holders}
    pool, evictable = by.get(POOL_FAMILY), by.get(EVICTABLE_FAMILY)
    if pool is None:
        return ()
    held = pool.to_dict()
    held["tree_evictable"] = evictable.total() if evictable is not None else 0
    return tuple(held.items())


class _WorkerCache:
    """Worker views by (source, epoch, buffer rows): a worker's groups do not change
    between heartbeats, so its rows are parsed once per change, not once per file
    version. Bounded: cleared when it holds `limit` entries."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._views: dict[tuple[Any, ...], WorkerView] = {}

    def get(self, published: Any) -> WorkerView:
        """`published`: an exporter.sources.Published. Raises BufferMapError when its
        buffer rows failed their checks (the caller leaves the source out)."""
        head = getattr(published, "_head", None)
        rows = head.rows if head is not None else None
        key = (published.source, published.summary.epoch, hash(rows) if rows else id(published))
        with self._lock:
            hit = self._views.get(key)
        if hit is not None:
            return hit
        view = worker_view(published.summary, published.snapshot.buffers)
        with self._lock:
            if len(self._views) >= self.limit:
                self._views.clear()
            self._views[key] = view
        return view


_WORKER_CACHE = _WorkerCache()


def worker_of(published: Any) -> WorkerView:
    """The worker view of a published vLLM worker file (cached per change)."""
    return _WORKER_CACHE.get(published)
