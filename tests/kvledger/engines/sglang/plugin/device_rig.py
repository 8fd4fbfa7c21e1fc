"""SGLang 0.5.23's DeepSeek-V4 pool, request pool and SWA allocator on a chosen device, and
requests through the allocator's own prefill and free calls.

The pool has the shape of `tests.kvledger.engines.sglang.rig` (its constants), built here with a
`device` argument so the same plugin path runs on the CPU and on cuda:0. On CUDA the
allocator's paged paths run SGLang's Triton kernels; on the CPU, its torch-native ones.
"""

from __future__ import annotations

from typing import Any

import torch

from kvledger.tools.bench.sglang_engine import pin_torch_native
from kvledger.tools.bench.sglang_pool import Sizes, build_allocator, build_pool, build_req_to_token
from tests.kvledger.engines.sglang import rig


def build(
    device: str, *, swa_pages: int = rig.SWA_PAGES, full_pages: int = rig.FULL_PAGES
) -> tuple[Any, Any, Any]:
    """(DeepSeekV4TokenToKVPool, ReqToTokenPool, SWATokenToKVPoolAllocator) on `device`."""
    sizes = Sizes.from_pages(requests=4, swa_pages=swa_pages, full_pages=full_pages, page=rig.PAGE)
    full = full_pages * rig.PAGE
    pool = build_pool(
        sizes, ratios=list(rig.RATIOS), page=rig.PAGE, window=rig.WINDOW, device=device
    )
    r2t = build_req_to_token(4, full, device)
    alloc = build_allocator(pool, r2t, full_tokens=full, page=rig.PAGE, device=device)
    if device == "cpu":  # SGLang picks Triton by platform: a GPU host would run it on CPU tensors
        pin_torch_native(alloc)
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
    if device == "cpu":  # as in `build`
        alloc.use_triton_kernels = False
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

    def finish_every_other(self) -> None:
        """Free the 1st, 3rd, ... live request: holes between the held rows."""
        for out in self.live[::2]:
            self.allocator.free(out)
        self.live = self.live[1::2]

    def finish_all(self) -> None:
        while self.live:
            self.allocator.free(self.live.pop())
