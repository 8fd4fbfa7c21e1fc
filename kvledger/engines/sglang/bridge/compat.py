"""Whether a DeepSeek-V4 pool's SWA buffers can be put on the VMM pool, and why not.

`SwaFacts` is what the bridge needs to know about one pool and its SWA
allocator, read from SGLang's objects by `read_facts` (duck-typed on SGLang
0.5.23's attribute names; nothing here imports sglang). `incompatibilities`
turns facts into reasons; an empty list means the bridge can attach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.engines.sglang.dsv4 import geometry as g

# SGLang 0.5.23's V4 SWA layout: 448 fp8 nope + 64 bf16 rope + 7 scale bytes + 1 pad per token,
# each page of tokens padded to a multiple of 576 bytes. The V4.1 layouts (v41, v41_new) store
# 528-byte tokens (512 fp8 values + 16 scales), pages padded to 512 or 528 bytes: a row is
# opaque bytes to the bridge, so any of the three is bridged alike.
V4_TOKEN_BYTES = 584
V4_PAGE_ALIGN = 576
BRIDGED_LAYOUTS = g.MAIN_KV_LAYOUTS  # v4, v41, v41_new
# Instance methods the bridge wraps on the SWA sub-allocator (PagedTokenToKVPoolAllocator).
WRAPPED_METHODS = (
    "alloc",
    "alloc_extend",
    "alloc_decode",
    "merge_and_sort_free",
    "_release_page_ids",
    "clear",
)


@dataclass(frozen=True)
class SwaFacts:
    pool_class: str
    is_dsv4_pool: bool
    has_swa_pool: bool  # False under unified KV, the request window, or no paged SWA
    swa_storage: str  # "paged", "unified", "ring", "request_window"
    kv_layout: str  # "v4", "v41", ...
    uniform_fp8: bool
    token_bytes: int  # kv_cache_total_dim of the SWA sub-pool
    page_tokens: int  # tokens per SWA page in the buffer (SWA sub-pool page_size)
    allocator_page_tokens: int  # tokens per page of the SWA allocator
    allocator_pages: int  # pages the SWA allocator hands out (1..allocator_pages)
    allocator_class: str
    allocator_missing: tuple[str, ...]  # wrapped methods the allocator lacks
    layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    contiguous: tuple[bool, ...]
    devices: tuple[str, ...]

    @property
    def rows(self) -> int:
        return self.shapes[0][0] if self.shapes and len(self.shapes[0]) == 2 else 0

    @property
    def row_bytes(self) -> int:
        return self.shapes[0][1] if self.shapes and len(self.shapes[0]) == 2 else 0


def layout_token_bytes(layout: str) -> int:
    """Bytes of one SWA token in `layout` (584 for v4, 528 for v41 / v41_new)."""
    return g.layout_token_bytes(layout)


def expected_row_bytes(page_tokens: int, layout: str = "v4") -> int:
    """SGLang's KVLayout.page_bytes: a page of tokens padded to the layout's page_align."""
    return g.layout_page_bytes(layout, page_tokens, layout_token_bytes(layout))


def pool_reasons(facts: SwaFacts) -> list[str]:
    """Why `facts`' pool has nothing the bridge could take (checked before anything else)."""
    if not facts.is_dsv4_pool:
        return [f"pool is a {facts.pool_class}, expected SGLang's DeepSeekV4TokenToKVPool"]
    if not facts.has_swa_pool:
        why = _STORAGE_REASONS.get(facts.swa_storage, "no paged SWA pool of its own to replace")
        return [f"SWA storage is {facts.swa_storage!r} ({why}), expected 'paged'"]
    return []


# Why each SWA storage but the paged one is left native: nothing for the bridge to follow.
_STORAGE_REASONS = {
    "request_window": (
        "encoder replay: each request slot keeps its last window of SWA rows in a "
        "request-window pool and a per-step workspace, addressed by slot, with no page "
        "allocator whose pages the bridge could map and unmap"
    ),
    "unified": (
        "the unified-KV ring: SWA ring rows and compressed rows share one tensor per layer, "
        "addressed by request slot, with no paged SWA pool"
    ),
    "ring": "a per-request draft SWA ring (DSpark), addressed by request slot, not by page",
}


def incompatibilities(facts: SwaFacts, *, granularity: int, backend_device: str) -> list[str]:
    """Reasons the bridge cannot take `facts`' SWA buffers on a backend of `granularity`
    bytes whose tensors live on `backend_device` ("cpu" or "cuda"); empty when it can."""
    f = facts
    reasons = pool_reasons(f)
    if reasons:
        return reasons
    if f.kv_layout not in BRIDGED_LAYOUTS:
        reasons.append(
            f"SWA KV layout {f.kv_layout!r}, expected one of {', '.join(BRIDGED_LAYOUTS)}"
        )
        return reasons
    if f.uniform_fp8:
        reasons.append("uniform-FP8 SWA pool (trtllm backend), expected the paged V4 pool")
    token = layout_token_bytes(f.kv_layout)
    if f.token_bytes != token:
        reasons.append(
            f"SWA token bytes {f.token_bytes}, expected {token} (the {f.kv_layout} layout)"
        )
    if f.page_tokens != f.allocator_page_tokens:
        reasons.append(
            f"SWA buffer page of {f.page_tokens} tokens differs from the allocator's page of "
            f"{f.allocator_page_tokens} tokens (e.g. SM120 direct SWA layout), expected equal"
        )
    if f.allocator_missing:
        reasons.append(
            f"SWA allocator {f.allocator_class} lacks {', '.join(f.allocator_missing)}, "
            "expected SGLang 0.5.23's PagedTokenToKVPoolAllocator"
        )
    if f.layers <= 0 or len(f.shapes) != f.layers:
        reasons.append(f"{len(f.shapes)} SWA buffers for {f.layers} layers, expected one each")
        return reasons
    if len(set(f.shapes)) != 1 or len(f.shapes[0]) != 2:
        reasons.append(f"SWA buffer shapes {sorted(set(f.shapes))}, expected one 2-D shape")
        return reasons
    if set(f.dtypes) != {"uint8"}:
        reasons.append(f"SWA buffer dtypes {sorted(set(f.dtypes))}, expected uint8")
    if not all(f.contiguous):
        reasons.append("an SWA buffer is not contiguous, expected each layer contiguous")
    devices = {d.split(":")[0] for d in f.devices}
    if devices != {backend_device}:
        reasons.append(
            f"SWA buffers on {sorted(set(f.devices))}, expected {backend_device} for the "
            f"{backend_device} VMM backend"
        )
    want_row = expected_row_bytes(f.page_tokens, f.kv_layout)
    if f.row_bytes != want_row:
        reasons.append(
            f"SWA row of {f.row_bytes} bytes, expected {want_row} ({f.page_tokens} tokens x "
            f"{token} bytes padded to a multiple of {g.KV_LAYOUTS[f.kv_layout][2]}, "
            f"the {f.kv_layout} layout)"
        )
    if f.allocator_pages + 1 > f.rows:
        reasons.append(
            f"allocator hands out pages 1..{f.allocator_pages} but the buffer has {f.rows} rows, "
            "expected a row for each page and the padding page 0"
        )
    if f.row_bytes > granularity:
        reasons.append(
            f"SWA row of {f.row_bytes} bytes exceeds the VMM page of {granularity} bytes, "
            "expected one row to touch at most two pages"
        )
    return reasons


def read_facts(pool: Any, swa_allocator: Any, *, dsv4_pool_class: type | None) -> SwaFacts:
    """Facts of a live SGLang 0.5.23 pool and its SWA sub-allocator (None when there is none).

    `dsv4_pool_class` is SGLang's DeepSeekV4TokenToKVPool (passed in so this module needs no
    sglang import); None makes every pool "not a DSV4 pool".
    """
    is_dsv4 = dsv4_pool_class is not None and isinstance(pool, dsv4_pool_class)
    sub = getattr(pool, "swa_kv_pool", None)
    if getattr(pool, "request_window", None) is not None:
        storage = "request_window"
    elif getattr(pool, "unified_kv_pool", None) is not None:  # set only in unified-KV mode
        storage = "unified"
    elif getattr(pool, "swa_req_ring_size", None) is not None:
        storage = "ring"
    else:
        storage = "paged" if sub is not None else "none"
    has_swa = storage == "paged" and sub is not None
    buffers = list(getattr(sub, "kv_buffer", None) or []) if has_swa else []
    layout = getattr(pool, "kv_layout", None)
    missing = tuple(
        m for m in WRAPPED_METHODS if swa_allocator is None or not hasattr(swa_allocator, m)
    )
    return SwaFacts(
        pool_class=type(pool).__name__,
        is_dsv4_pool=is_dsv4,
        has_swa_pool=has_swa,
        swa_storage=storage,
        kv_layout=str(getattr(layout, "value", layout)).lower(),
        uniform_fp8=bool(getattr(pool, "uniform_fp8", False)),
        token_bytes=int(getattr(sub, "kv_cache_total_dim", 0) or 0) if has_swa else 0,
        page_tokens=int(getattr(sub, "page_size", 0) or 0) if has_swa else 0,
        allocator_page_tokens=int(getattr(swa_allocator, "page_size", 0) or 0),
        allocator_pages=int(getattr(swa_allocator, "num_pages", 0) or 0),
        allocator_class=type(swa_allocator).__name__,
        allocator_missing=missing,
        layers=len(buffers),
        shapes=tuple(tuple(int(s) for s in b.shape) for b in buffers),
        dtypes=tuple(str(b.dtype).removeprefix("torch.") for b in buffers),
        contiguous=tuple(bool(b.is_contiguous()) for b in buffers),
        devices=tuple(str(b.device) for b in buffers),
    )
