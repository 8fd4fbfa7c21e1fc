"""Register the runtime-owned families of a live DeepSeek-V4 pool with a ledger.

SGLang keeps these buffers (C4/C128 KV, the C4 indexer, compressor and indexer
state); the ledger accounts for them as runtime-owned, one account per family
(one index space shared by that family's layer buffers). Read through the
attributes SGLang 0.5.23 defines; names are `<family>.L<global layer>`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from accounting.buffers import BufferSpec, runtime_buffer
from accounting.ledger import Account, Ledger

# family -> tokens (or rows) per row of its paged buffer, for capacity in entries
_PAGED = {"c4_kv": 4, "c128_kv": 128, "c4_indexer": 4}


def runtime_tensors(pool: Any, *, include_swa: bool) -> Iterator[tuple[str, int, Any]]:
    """(family, global layer, tensor) for every runtime-owned buffer of `pool`."""
    start = int(getattr(pool, "_stage_start", 0) or 0)
    stage = list(pool.compression_ratios)[start : int(getattr(pool, "_stage_end", 0) or 0)]
    by_ratio = {r: [start + i for i, x in enumerate(stage) if x == r] for r in (4, 128)}
    sub = getattr(pool, "swa_kv_pool", None)
    if include_swa and sub is not None:
        for i, t in enumerate(sub.kv_buffer):
            yield "swa_kv", start + i, t
    kv_pools = getattr(pool, "kv_pools", {}) or {}
    for ratio, family in ((4, "c4_kv"), (128, "c128_kv")):
        p = kv_pools.get(ratio)
        if p is not None:
            for local, t in enumerate(p.kv_buffer):
                yield family, by_ratio[ratio][local], t
    idx = (getattr(pool, "index_pools", {}) or {}).get(4)
    if idx is not None:
        for local, t in enumerate(idx.index_k_with_scale_buffer):
            yield "c4_indexer", by_ratio[4][local], t
    for layer, st in enumerate(getattr(pool, "compress_state_pools", []) or []):
        if st is not None:
            family = "c4_attn_state" if st.ratio == 4 else "c128_state"
            yield family, layer, st.kv_score_buffer.kv_score
    for layer, st in enumerate(getattr(pool, "indexer_compress_state_pools", []) or []):
        if st is not None:
            yield "c4_indexer_state", layer, st.kv_score_buffer.kv_score


def runtime_specs(pool: Any, *, pool_name: str, include_swa: bool) -> dict[str, list[BufferSpec]]:
    page = int(getattr(pool, "page_size", 256) or 256)
    out: dict[str, list[BufferSpec]] = {}
    for family, layer, t in runtime_tensors(pool, include_swa=include_swa):
        rows = int(t.shape[0])
        per_row = page if family == "swa_kv" else page // _PAGED.get(family, page)
        capacity = rows * per_row if family in _PAGED or family == "swa_kv" else rows
        out.setdefault(family, []).append(
            runtime_buffer(
                t,
                name=f"{family}.L{layer}",
                family=family,
                pool=pool_name,
                layer=layer,
                capacity_slots=capacity,
            )
        )
    return out


def register_runtime(
    pool: Any, ledger: Ledger, *, pool_name: str, exclude: Iterable[str]
) -> list[Account]:
    """Add one runtime account per family of `pool` (families in `exclude` left out);
    all or nothing."""
    skip = set(exclude)
    specs = runtime_specs(pool, pool_name=pool_name, include_swa="swa_kv" not in skip)
    added: list[Account] = []
    try:
        for family, buffers in specs.items():
            if family not in skip:
                added.append(ledger.add_account(buffers))
    except BaseException:
        for account in added:
            ledger.remove_account(account)
        raise
    return added
