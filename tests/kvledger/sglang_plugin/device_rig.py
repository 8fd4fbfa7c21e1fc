"""SGLang 0.5.23's DeepSeek-V4 pool, request pool and SWA allocator on a chosen device, and
requests through the allocator's own prefill and free calls.

The pool has the shape of `tests.kvledger.sglang_rig` (its constants), built here with a
`device` argument so the same plugin path runs on the CPU and on cuda:0. On CUDA the
allocator's paged paths run SGLang's Triton kernels; on the CPU, its torch-native ones.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.kvledger import sglang_rig as rig


def build(
    device: str, *, swa_pages: int = rig.SWA_PAGES, full_pages: int = rig.FULL_PAGES
) -> tuple[Any, Any, Any]:
    """(DeepSeekV4TokenToKVPool, ReqToTokenPool, SWATokenToKVPoolAllocator) on `device`."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    ratios = list(rig.RATIOS)
    full = full_pages * rig.PAGE
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=4,
        num_req_slots=5,
        swa_size=swa_pages * rig.PAGE,
        c4_size=full // 4,
        c128_size=full // 128,
        c4_state_pool_size=8 * (swa_pages + 1),
        c128_state_pool_size=128 * 5,
        page_size=rig.PAGE,
        swa_page_size=rig.PAGE,
        sliding_window=rig.WINDOW,
        dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=len(ratios),
        device=device,
        enable_memory_saver=False,
        compression_ratios=ratios,
        start_layer=0,
        end_layer=len(ratios),
        full_size=full,
    )
    r2t = ReqToTokenPool(4, full, device, False)
    alloc = SWATokenToKVPoolAllocator(
        full,
        pool.swa_size,
        page_size=rig.PAGE,
        dtype=torch.float8_e4m3fn,
        device=device,
        kvcache=pool,
        need_sort=False,
        req_to_token_pool=r2t,
    )
    return pool, r2t, alloc


def build_plain(kind: str, device: str, *, pages: int = 16) -> tuple[Any, Any, Any]:
    """(MLATokenToKVPool or MHATokenToKVPool, ReqToTokenPool, PagedTokenToKVPoolAllocator),
    page 16, on `device`: the pools of a model without DeepSeek-V4's families."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )

    page, size = 16, pages * 16
    if kind == "mla":
        pool: Any = MLATokenToKVPool(
            size=size,
            page_size=page,
            dtype=torch.bfloat16,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            layer_num=3,
            device=device,
            enable_memory_saver=False,
        )
    elif kind == "mha":
        pool = MHATokenToKVPool(
            size=size,
            page_size=page,
            dtype=torch.bfloat16,
            head_num=4,
            head_dim=64,
            layer_num=3,
            device=device,
            enable_memory_saver=False,
        )
    else:
        raise ValueError(f"kind={kind!r}, expected 'mla' or 'mha'")
    r2t = ReqToTokenPool(4, size, device, False)
    alloc = PagedTokenToKVPoolAllocator(size, page, torch.bfloat16, device, pool, False)
    return pool, r2t, alloc


class Requests:
    """Prefills through `alloc_extend` (no prefix) and frees through `free`, as SGLang's
    scheduler does for a request that is admitted and then finishes."""

    def __init__(self, allocator: Any, r2t: Any, device: str) -> None:
        self.allocator = allocator
        self.device = device
        self.live: list[Any] = []

    def prefill(self, n: int) -> Any:
        d = self.device
        zero_cpu, lens_cpu = torch.tensor([0]), torch.tensor([n])
        out = self.allocator.alloc_extend(
            zero_cpu.to(d),
            zero_cpu,
            lens_cpu.to(d),
            lens_cpu,
            torch.tensor([-1], device=d),
            n,
        )
        if out is None:
            raise RuntimeError(f"SGLang's allocator has no pages for {n} tokens")
        self.live.append(out)
        return out

    def finish_all(self) -> None:
        while self.live:
            self.allocator.free(self.live.pop())
