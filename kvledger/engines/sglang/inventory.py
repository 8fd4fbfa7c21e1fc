"""Inventory of a live SGLang KV pool: walk its tensors into the ledger as runtime-owned buffers.

Duck-typed over SGLang 0.5.23's pool classes; nothing here imports sglang (or
torch). Recognised shapes of pool object, by the attributes they carry:

- DeepSeekV4TokenToKVPool: `swa_kv_pool.kv_buffer`, `kv_pools[ratio].kv_buffer`,
  `index_pools[ratio].index_k_with_scale_buffer`, `compress_state_pools[layer]` and
  `indexer_compress_state_pools[layer]` (each a CompressStatePool whose
  `kv_score_buffer.kv_score` is the tensor). `c4_kv_pool`, `c128_kv_pool` and
  `c4_indexer_kv_pool` alias the same sub-pools and are not walked again.
  DeepSeek-V4.1's low ratios 1 and 2 (`c1_kv`, `c2_kv`, `c1_indexer`, `c2_indexer`,
  `c2_state`) belong to their kv_source layers (`sources_by_ratio`). The two SWA
  storages without a paged SWA pool are walked too: under encoder replay the
  `request_window` (its `state` pool is the SWA KV of every layer, family `swa_kv`, one
  window of `capacity` rows per request slot; its `workspace` pool, family
  `swa_window_workspace`; its `tags`, family `swa_window_tags`), and the unified-KV
  ring's `unified_kv_pool` (`kv_buffer`, family `unified_kv`: SWA ring rows and
  compressed rows in one tensor per layer; `kv_buffer_rope` under fp8, family
  `unified_kv_rope`).
- SWAKVPool: `full_kv_pool` and `swa_kv_pool`, with `layers_mapping`.
- HybridLinearKVPool (linear-attention / Mamba state beside full attention):
  `full_kv_pool` (walked as its own kind, layers mapped back through
  `full_attention_layer_id_mapping`) and `mamba_pool.mamba_cache`, whose `conv`
  tensors (family `mamba_conv`) and `temporal` tensor (family `mamba_temporal`) stack
  every state layer along dim 0 and the request slots along dim 1.
- MHATokenToKVPool: per-layer `k_buffer` / `v_buffer` lists (families `k`, `v`).
- Any other KVCache with a per-layer `kv_buffer` list (family `kv`; MLA pools).

A pool of none of these shapes is refused (`ValueError`), or, with
`allow_unknown=True`, reported as such: kind `unknown`, every tensor storage
reachable from it under family `unknown`, never classified into a family it may
not have.

A buffer of SGLang's own VMM backing (`KvVmmBufferOwner`, post-capture KV sizing) is
registered VMM-owned, one account per buffer: reserved bytes its virtual extent, physical
and mapped bytes its backed span (`kvledger.engines.sglang.vmm_owner`).

Every tensor storage is counted once, keyed by its device and data pointer,
however many attributes or views reach it. Storages reachable from the pool
that none of the walks above claims are registered under family `other`, so the
ledger's physical total is the pool's whole tensor memory.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.buffers import BufferSpec, Owner, runtime_buffer
from accounting.events import PoolEvent
from accounting.ledger import Account, Ledger
from kvledger.engines.sglang.dsv4.buffermap import ALL_FAMILIES
from kvledger.engines.sglang.vmm_owner import Backed, backed_buffers

# Families of the DeepSeek-V4 pool (docs/background.md#deepseek-v4-geometry, defined in
# kvledger.engines.sglang.dsv4; V4.1's low-ratio ones included), those of the SWA storages with no
# paged SWA pool, then the generic ones.
DSV4_FAMILIES = ALL_FAMILIES
DSV4_STORAGE_FAMILIES = (
    "swa_window_workspace",
    "swa_window_tags",
    "unified_kv",
    "unified_kv_rope",
)
GENERIC_FAMILIES = ("k", "v", "kv", "swa_k", "swa_v", "swa_kv", "other")
STATE_FAMILIES = ("mamba_conv", "mamba_temporal")
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Found:
    """One tensor found in a pool, before deduplication."""

    family: str
    layer: int | None
    tensor: Any
    capacity_slots: int | None = None  # None: rows along dim 0


@dataclass(frozen=True)
class Inventory:
    pool: str
    kind: str  # "dsv4", "hybrid_linear", "swa", "mha", "kv", or "unknown" (allow_unknown)
    specs: tuple[BufferSpec, ...]
    accounts: tuple[Account, ...] = ()
    backed: Mapping[str, Backed] = field(default_factory=dict)  # spec name -> SGLang VMM buffer

    @property
    def storage_bytes(self) -> int:
        """Bytes of the unique storages registered (each counted once)."""
        return sum(s.reserved_bytes for s in self.specs)

    @property
    def tensor_bytes(self) -> int:
        return sum(s.tensor_bytes for s in self.specs)

    def families(self) -> dict[str, tuple[BufferSpec, ...]]:
        out: dict[str, list[BufferSpec]] = {}
        for s in self.specs:
            out.setdefault(s.family, []).append(s)
        return {f: tuple(v) for f, v in out.items()}


def pool_kind(pool: Any) -> str:
    if all(hasattr(pool, a) for a in ("swa_kv_pool", "kv_pools", "compress_state_pools")):
        return "dsv4"
    if hasattr(pool, "full_kv_pool") and hasattr(getattr(pool, "mamba_pool", None), "mamba_cache"):
        return "hybrid_linear"
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool"):
        return "swa"
    if isinstance(getattr(pool, "k_buffer", None), (list, tuple)):
        return "mha"
    if isinstance(getattr(pool, "kv_buffer", None), (list, tuple)):
        return "kv"
    raise ValueError(
        f"pool of type {type(pool).__name__}: expected an SGLang KV pool "
        "(DeepSeekV4TokenToKVPool, HybridLinearKVPool, SWAKVPool, MHATokenToKVPool or a "
        "KVCache with kv_buffer)"
    )


def inventory(pool: Any, *, name: str = "kv", allow_unknown: bool = False) -> Inventory:
    """The pool's buffers as BufferSpecs, one per unique storage; registers nothing.

    Where one storage backs several tensors (SGLang 0.5.23's MHA pool allocates a
    layer's K and V as two halves of one buffer), the spec covers the storage: its
    family joins theirs (`k` + `v` -> `kv`), its tensor bytes add theirs up.
    A pool of no known shape raises ValueError, or with `allow_unknown` is kind
    `unknown` with its reachable storages in family `unknown`.
    """
    try:
        kind = pool_kind(pool)
    except ValueError:
        if not allow_unknown:
            raise
        kind = UNKNOWN
    if kind == UNKNOWN:
        found = [Found(UNKNOWN, None, t) for t in _reachable_tensors(pool)]
        if not found:
            raise ValueError(
                f"pool of type {type(pool).__name__}: not a known SGLang KV pool and no "
                "tensor reachable from it"
            )
    else:
        found = list(_walk(pool, kind))
        found += [Found("other", None, t) for t in _reachable_tensors(pool)]
    groups: dict[tuple[str, int], list[Found]] = {}
    for f in found:
        groups.setdefault(_storage_key(f.tensor), []).append(f)
    specs: list[BufferSpec] = []
    names: dict[str, int] = {}
    vmm = backed_buffers(pool) if kind != UNKNOWN else {}
    backed: dict[str, Backed] = {}
    for key, members in groups.items():
        spec = _spec(members, name, names)
        b = vmm.get(key)
        if b is not None and b.granularity > 0 and spec.tensor_bytes <= b.reserved_bytes:
            spec = dataclasses.replace(spec, owner=Owner.VMM, reserved_bytes=b.reserved_bytes)
            backed[spec.name] = b
        specs.append(spec)
    return Inventory(pool=name, kind=kind, specs=tuple(specs), backed=backed)


def _spec(members: list[Found], pool: str, names: dict[str, int]) -> BufferSpec:
    # Distinct views of the storage, in the order found; "other" sightings add nothing.
    views: list[Found] = []
    for f in members:
        if f.family == "other" and (views or len(members) > 1):
            continue
        if any(_same_view(f.tensor, v.tensor) for v in views):
            continue
        views.append(f)
    first = views[0]
    family = _joined_family([v.family for v in views])
    base = f"{family}.L{first.layer}" if first.layer is not None else family
    n = names.get(base, 0)
    names[base] = n + 1
    label = base if n == 0 else f"{base}#{n}"
    spec = runtime_buffer(
        first.tensor,
        name=label,
        family=family,
        pool=pool,
        layer=first.layer,
        capacity_slots=first.capacity_slots,
    )
    if len(views) == 1:
        return spec
    storage = int(first.tensor.untyped_storage().nbytes())
    tensor_bytes = min(
        storage, sum(int(v.tensor.numel()) * int(v.tensor.element_size()) for v in views)
    )
    shapes = {tuple(int(d) for d in v.tensor.shape) for v in views}
    shape = (len(views), *spec.shape) if len(shapes) == 1 else (storage,)
    return BufferSpec(
        name=label,
        family=family,
        pool=pool,
        owner=spec.owner,
        layer=first.layer,
        dtype=spec.dtype,
        shape=shape,
        slot_bytes=spec.slot_bytes * len(views) if len(shapes) == 1 else spec.slot_bytes,
        capacity_slots=spec.capacity_slots,
        tensor_bytes=tensor_bytes,
        reserved_bytes=max(storage, tensor_bytes),
    )


def _same_view(a: Any, b: Any) -> bool:
    return a is b or (
        int(a.data_ptr()) == int(b.data_ptr())
        and tuple(a.shape) == tuple(b.shape)
        and a.dtype == b.dtype
    )


def _joined_family(families: list[str]) -> str:
    uniq = list(dict.fromkeys(families))
    if len(uniq) == 1:
        return uniq[0]
    if set(uniq) == {"k", "v"}:
        return "kv"
    if set(uniq) == {"swa_k", "swa_v"}:
        return "swa_kv"
    return "+".join(uniq)


def register_pool(
    ledger: Ledger,
    pool: Any,
    *,
    name: str = "kv",
    allow_unknown: bool = False,
    exclude: Iterable[str] = (),
) -> Inventory:
    """Walk `pool` and add one runtime-owned account per family to `ledger`, but for the
    families in `exclude` (registered by someone else, e.g. the VMM bridge); all or nothing."""
    inv = inventory(pool, name=name, allow_unknown=allow_unknown)
    skip = set(exclude)
    accounts: list[Account] = []
    try:
        for family, specs in inv.families().items():
            if family in skip:
                continue
            runtime = [s for s in specs if s.name not in inv.backed]
            if runtime:
                capacity = max(s.capacity_slots for s in runtime)
                accounts.append(
                    ledger.add_account(runtime, key=f"{name}/{family}", capacity_slots=capacity)
                )
            for spec in specs:
                b = inv.backed.get(spec.name)
                if b is not None:
                    accounts.append(
                        _backed_account(ledger, spec, b, f"{name}/{family}/{spec.name}")
                    )
    except BaseException:
        unregister(ledger, accounts)
        raise
    return dataclasses.replace(inv, accounts=tuple(accounts))


def _backed_account(ledger: Ledger, spec: BufferSpec, b: Backed, key: str) -> Account:
    """One SGLang VMM-backed buffer as a VMM-owned account: its backed granules are live
    handles, all mapped (SGLang maps each handle as it creates it)."""
    account = ledger.add_account(
        [spec], key=key, page_bytes=b.granularity, capacity_slots=spec.capacity_slots
    )
    pages = b.backed_bytes // b.granularity
    if pages:
        account.on_pool_event(PoolEvent.HANDLES_CREATED, pages)
        account.on_pool_event(PoolEvent.PAGES_MAPPED, pages)
    return account


def unregister(ledger: Ledger, accounts: Iterable[Account]) -> None:
    """Remove accounts `register_pool` added (an SGLang VMM-backed buffer's pages reported
    gone first: SGLang frees them with the pool)."""
    for account in accounts:
        if account.owner is Owner.VMM and account._flush is None:
            if account.mapped_pages:
                account.on_pool_event(PoolEvent.PAGES_UNMAPPED, account.mapped_pages)
            if account.handle_pages:
                account.on_pool_event(PoolEvent.HANDLES_RELEASED, account.handle_pages)
        ledger.remove_account(account)


# -- walks -------------------------------------------------------------------------
def _walk(pool: Any, kind: str, prefix: str = "") -> Iterator[Found]:
    if kind == "dsv4":
        yield from _walk_dsv4(pool)
    elif kind == "hybrid_linear":
        yield from _walk_hybrid_linear(pool)
    elif kind == "swa":
        yield from _walk_swa(pool)
    elif kind == "mha":
        start = int(getattr(pool, "start_layer", 0) or 0)
        for i, t in enumerate(pool.k_buffer):
            yield Found(prefix + "k", start + i, t)
        for i, t in enumerate(getattr(pool, "v_buffer", None) or ()):
            yield Found(prefix + "v", start + i, t)
    else:
        start = int(getattr(pool, "start_layer", 0) or 0)
        for i, t in enumerate(pool.kv_buffer):
            yield Found(prefix + "kv", start + i, t)


def _walk_swa(pool: Any) -> Iterator[Found]:
    mapping = getattr(pool, "layers_mapping", {}) or {}
    to_global = {(local, is_swa): g for g, (local, is_swa) in mapping.items()}
    for sub, is_swa in ((pool.full_kv_pool, False), (pool.swa_kv_pool, True)):
        if sub is None:
            continue
        prefix = "swa_" if is_swa else ""
        for f in _walk(sub, pool_kind(sub), prefix):
            layer = f.layer
            if layer is not None:
                local = layer - int(getattr(sub, "start_layer", 0) or 0)
                layer = to_global.get((local, is_swa), layer)
            yield Found(f.family, layer, f.tensor, f.capacity_slots)


def _walk_hybrid_linear(pool: Any) -> Iterator[Found]:
    mapping = getattr(pool, "full_attention_layer_id_mapping", None) or {}
    to_global = {int(local): int(g) for g, local in mapping.items()}
    full = pool.full_kv_pool
    if full is not None:
        start = int(getattr(full, "start_layer", 0) or 0)
        for f in _walk(full, pool_kind(full)):
            layer = f.layer
            if layer is not None:
                layer = to_global.get(layer - start, layer)
            yield Found(f.family, layer, f.tensor, f.capacity_slots)
    cache = pool.mamba_pool.mamba_cache
    for t in getattr(cache, "conv", None) or ():
        yield Found("mamba_conv", None, t, _slots_along_dim1(t))
    temporal = getattr(cache, "temporal", None)
    if temporal is not None:
        yield Found("mamba_temporal", None, temporal, _slots_along_dim1(temporal))


def _slots_along_dim1(t: Any) -> int | None:
    """Request slots of a [layers, slots, ...] state tensor."""
    return int(t.shape[1]) if len(t.shape) >= 2 else None


def _walk_dsv4(pool: Any) -> Iterator[Found]:
    ratios = list(pool.compression_ratios)
    start = int(getattr(pool, "_stage_start", 0))
    end = int(getattr(pool, "_stage_end", len(ratios)))
    by_ratio = {r: [i for i in range(start, end) if ratios[i] == r] for r in (4, 128)}
    # V4.1: a ratio-1/2 pool has one buffer per kv_source layer of that ratio.
    sources = getattr(pool, "sources_by_ratio", None) or {}
    for r in (1, 2):
        by_ratio[r] = [int(i) for i in sources.get(r, ())]

    swa = pool.swa_kv_pool
    if swa is not None:
        for i, t in enumerate(swa.kv_buffer):
            yield Found("swa_kv", start + i, t, _paged_capacity(t, swa.page_size))
    yield from _walk_request_window(getattr(pool, "request_window", None), start)
    yield from _walk_unified(getattr(pool, "unified_kv_pool", None), start)
    for ratio, sub in (pool.kv_pools or {}).items():
        if sub is None or int(ratio) not in by_ratio:
            continue
        for j, t in enumerate(sub.kv_buffer):
            yield Found(
                f"c{int(ratio)}_kv",
                _nth(by_ratio[int(ratio)], j),
                t,
                _paged_capacity(t, sub.page_size),
            )
    for ratio, idx in (getattr(pool, "index_pools", None) or {}).items():
        if idx is None or int(ratio) not in by_ratio:
            continue
        lists: Iterable[Any] = (
            [idx.index_k_with_scale_buffer]
            if getattr(idx, "index_k_with_scale_buffer", None) is not None
            else [
                getattr(idx, "index_k_payload_buffer", ()),
                getattr(idx, "index_k_scale_buffer", ()),
            ]
        )
        for bufs in lists:
            for j, t in enumerate(bufs):
                yield Found(
                    f"c{int(ratio)}_indexer",
                    _nth(by_ratio[int(ratio)], j),
                    t,
                    _paged_capacity(t, idx.page_size),
                )
    for layer, st in enumerate(pool.compress_state_pools or ()):
        if st is not None:
            family = "c4_attn_state" if int(st.ratio) == 4 else f"c{int(st.ratio)}_state"
            yield Found(family, layer, _state_tensor(st))
    for layer, st in enumerate(getattr(pool, "indexer_compress_state_pools", None) or ()):
        if st is not None:
            yield Found(f"c{int(st.ratio)}_indexer_state", layer, _state_tensor(st))


def _walk_request_window(window: Any, start: int) -> Iterator[Found]:
    """SGLang 0.5.23's dsv41_request_window.RequestWindow (encoder replay)."""
    if window is None:
        return
    state = getattr(window, "state", None)
    if state is not None:
        for i, t in enumerate(state.kv_buffer):
            yield Found("swa_kv", start + i, t, _paged_capacity(t, state.page_size))
    workspace = getattr(window, "workspace", None)
    if workspace is not None:
        for t in workspace.kv_buffer:
            yield Found("swa_window_workspace", None, t, _paged_capacity(t, workspace.page_size))
    tags = getattr(window, "tags", None)
    if tags is not None:
        yield Found("swa_window_tags", None, tags, _slots_along_dim1(tags))


def _walk_unified(unified: Any, start: int) -> Iterator[Found]:
    """SGLang 0.5.23's DeepSeekV4UnifiedKVPool: one tensor of rows per layer."""
    if unified is None:
        return
    for i, t in enumerate(getattr(unified, "kv_buffer", None) or ()):
        if t is not None:
            yield Found("unified_kv", start + i, t)
    for i, t in enumerate(getattr(unified, "kv_buffer_rope", None) or ()):
        if t is not None:
            yield Found("unified_kv_rope", start + i, t)


def _nth(layers: list[int], j: int) -> int | None:
    return layers[j] if j < len(layers) else None


def _paged_capacity(t: Any, page_size: Any) -> int | None:
    """Slots of a [pages, page bytes] buffer: pages x entries per page."""
    if isinstance(page_size, int) and page_size > 0 and len(t.shape) >= 1:
        return int(t.shape[0]) * page_size
    return None


def _state_tensor(st: Any) -> Any:
    buf = st.kv_score_buffer
    return getattr(buf, "kv_score", buf)


# -- storages --------------------------------------------------------------------
def _is_tensor(x: Any) -> bool:
    return (
        not isinstance(x, (types.ModuleType, type))
        and callable(getattr(x, "untyped_storage", None))
        and callable(getattr(x, "element_size", None))
        and hasattr(x, "shape")
    )


def _storage_key(t: Any) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), int(storage.data_ptr()))


def _reachable_tensors(root: Any, max_depth: int = 4) -> Iterator[Any]:
    """Tensors reachable from `root` through instance attributes, lists, tuples and dict
    values, `max_depth` hops at most; each object visited once."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if _is_tensor(obj):
            yield obj
            continue
        if depth >= max_depth:
            continue
        if isinstance(obj, dict):
            children: Iterable[Any] = obj.values()
        elif isinstance(obj, (list, tuple)):
            children = obj
        elif hasattr(obj, "__dict__") and not isinstance(
            obj, (type, types.ModuleType, types.FunctionType, types.MethodType)
        ):
            children = vars(obj).values()
        else:
            continue
        for child in children:
            if isinstance(child, (str, bytes, int, float, bool)) or child is None:
                continue
            stack.append((child, depth + 1))
