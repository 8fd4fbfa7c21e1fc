"""SGLang 0.5.23's DeepSeek-V4 KV pool, request-to-token pool and SWA allocator, built from
explicit sizes.

The one place that spells out `DeepSeekV4TokenToKVPool(...)`'s keyword arguments and the
`ReqToTokenPool` / `SWATokenToKVPoolAllocator` beside it, for the bench engine and the
tests' rigs. Every size, the device, the page, the window and the state dtypes are the
caller's; `Sizes.from_pages` derives the pool's token counts from pages the way the bench
and the rigs size them. Importing this module needs neither sglang nor torch; the
functions import them when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# DeepSeek-V4's head dims (docs/background.md#deepseek-v4-geometry): the non-rotary and
# rotary parts of a query/key head, and the indexer's head.
QK_NOPE_HEAD_DIM = 448
QK_ROPE_HEAD_DIM = 64
INDEXER_HEAD_DIM = 128
# Rows of the c4 compress-state pool per SWA page (plus its padding page) and of the c128
# one per request slot, as the bench and the rigs size them.
C4_STATE_PER_SWA_PAGE = 8
C128_STATE_PER_SLOT = 128


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}, expected a positive int")
    return v


@dataclass(frozen=True)
class Sizes:
    """The pool's sizes, in SGLang's units: `requests` (max_num_reqs), `slots`
    (num_req_slots), tokens of the SWA, c4 and c128 spaces, rows of the c4 and c128
    compress-state pools, and the full-token space (`full_tokens`; None leaves SGLang's
    default)."""

    requests: int
    slots: int
    swa_tokens: int
    c4_tokens: int
    c128_tokens: int
    c4_state_size: int
    c128_state_size: int
    full_tokens: int | None

    def __post_init__(self) -> None:
        for name in (
            "requests",
            "slots",
            "swa_tokens",
            "c4_tokens",
            "c128_tokens",
            "c4_state_size",
            "c128_state_size",
        ):
            _positive(f"Sizes.{name}", getattr(self, name))
        if self.full_tokens is not None:
            _positive("Sizes.full_tokens", self.full_tokens)

    @classmethod
    def from_pages(cls, *, requests: int, swa_pages: int, full_pages: int, page: int) -> Sizes:
        """`requests` request slots (plus SGLang's one spare), `swa_pages` SWA pages and
        `full_pages` pages of the full-token space, pages of `page` tokens; the c4 and c128
        spaces are the full space over 4 and 128."""
        for name, v in (
            ("requests", requests),
            ("swa_pages", swa_pages),
            ("full_pages", full_pages),
            ("page", page),
        ):
            _positive(name, v)
        slots = requests + 1
        full = full_pages * page
        return cls(
            requests=requests,
            slots=slots,
            swa_tokens=swa_pages * page,
            c4_tokens=full // 4,
            c128_tokens=full // 128,
            c4_state_size=C4_STATE_PER_SWA_PAGE * (swa_pages + 1),
            c128_state_size=C128_STATE_PER_SLOT * slots,
            full_tokens=full,
        )


def build_pool(
    sizes: Sizes,
    *,
    ratios: list[int],
    page: int,
    window: int,
    device: str,
    layers: int | None = None,
    c4_state_dtype: Any = None,
    c128_state_dtype: Any = None,
    qk_nope_head_dim: int = QK_NOPE_HEAD_DIM,
    qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
    indexer_head_dim: int = INDEXER_HEAD_DIM,
    **extra: Any,
) -> Any:
    """SGLang's `DeepSeekV4TokenToKVPool` with fp8 KV, `ratios` per layer (`layers` layers,
    default len(ratios)), state dtypes float32 unless given; `extra` goes to SGLang as is
    (e.g. kv_layout, online_mtp_max_draft_tokens)."""
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    layer_num = len(ratios) if layers is None else _positive("layers", layers)
    if sizes.full_tokens is not None:
        extra = {**extra, "full_size": sizes.full_tokens}
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=sizes.requests,
        num_req_slots=sizes.slots,
        swa_size=sizes.swa_tokens,
        c4_size=sizes.c4_tokens,
        c128_size=sizes.c128_tokens,
        c4_state_pool_size=sizes.c4_state_size,
        c128_state_pool_size=sizes.c128_state_size,
        page_size=page,
        swa_page_size=page,
        sliding_window=window,
        dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32 if c4_state_dtype is None else c4_state_dtype,
        c128_state_dtype=torch.float32 if c128_state_dtype is None else c128_state_dtype,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        indexer_head_dim=indexer_head_dim,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
        compression_ratios=list(ratios),
        start_layer=0,
        end_layer=layer_num,
        **extra,
    )


def build_req_to_token(requests: int, max_context: int, device: str) -> Any:
    """SGLang's `ReqToTokenPool`: `requests` rows of `max_context` tokens, no memory saver."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(requests, max_context, device, False)


def build_allocator(
    pool: Any,
    req_to_token: Any,
    *,
    full_tokens: int,
    page: int,
    device: str,
    need_sort: bool = False,
) -> Any:
    """SGLang's `SWATokenToKVPoolAllocator` over `pool` (its SWA space) and `full_tokens`
    tokens of the full space, fp8."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(
        full_tokens,
        pool.swa_size,
        page_size=page,
        dtype=torch.float8_e4m3fn,
        device=device,
        kvcache=pool,
        need_sort=need_sort,
        req_to_token_pool=req_to_token,
    )
