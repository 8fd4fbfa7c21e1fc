"""Real SGLang 0.5.23 DeepSeek-V4 pools, allocators and a scheduler's page life cycle, on CPU.

Imported only by tests marked `sglang` (and the writes helper they run). The
pool, `ReqToTokenPool`, `SWATokenToKVPoolAllocator` and the free paths
(`free_swa_out_of_window_slots`, `free_kv_row_segments`) are SGLang's own;
`RequestKv` (from `kvledger.tools.bench.sglang_engine`) stands in for SGLang's
`ReqKvInfo`, whose module (`managers.schedule_batch`) pulls in the OpenAI client
and more that the light venv does not carry: it has the fields those free paths
read.

The rig is pinned to the CPU: its pools and allocators are on "cpu" on every
machine, and `make_allocator` makes SGLang's paged allocators run their
torch-native paths, which SGLang itself only picks on a CPU-only platform (where
CUDA is present it picks its Triton kernels whatever the pool's device, and
they cannot take CPU tensors). The CUDA pools are the `gpu` tests' business
(test_sglang_bridge_gpu.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvledger.tools.bench.sglang_engine import RequestKv, pin_torch_native
from kvledger.tools.bench.sglang_pool import Sizes, build_allocator, build_pool, build_req_to_token
from tests.kvledger.engines.sglang.sglang_reference import publish_only
from tests.kvledger.engines.sglang.sglang_reference import published as reference_published

__all__ = ["RequestKv"]

PAGE = 256
RATIOS = [0, 0, 4, 128, 4, 128]
SWA_PAGES = 8
FULL_PAGES = 20
WINDOW = 128


SERVER_ARGS = {"page_size": PAGE, "swa_full_tokens_ratio": 0.1}


@contextlib.contextmanager
def published() -> Iterator[None]:
    """SGLang's runtime context with a ServerArgs for DeepSeek-V4 (page 256)."""
    with reference_published(**SERVER_ARGS):
        yield


def make_pool_with(server_args: dict[str, Any], **kw: Any) -> Any:
    """make_pool under a ServerArgs with these fields too (encoder replay, ...); the rig's own
    context is published again afterwards."""
    try:
        publish_only(**SERVER_ARGS, **server_args)
        return make_pool(**kw)
    finally:
        publish_only(**SERVER_ARGS)


def make_pool(*, ratios: list[int] | None = None, swa_pages: int = SWA_PAGES, **kw: Any) -> Any:
    sizes = Sizes.from_pages(requests=4, swa_pages=swa_pages, full_pages=FULL_PAGES, page=PAGE)
    return build_pool(
        sizes,
        ratios=list(RATIOS if ratios is None else ratios),
        page=PAGE,
        window=WINDOW,
        device="cpu",
        **kw,
    )


def make_allocator(
    pool: Any, req_to_token: Any, *, page_size: int = PAGE, need_sort: bool = False
) -> Any:
    alloc = build_allocator(
        pool,
        req_to_token,
        full_tokens=FULL_PAGES * PAGE,
        page=page_size,
        device="cpu",
        need_sort=need_sort,
    )
    pin_torch_native(alloc)
    return alloc


def make_req_to_token() -> Any:
    return build_req_to_token(4, 4096, "cpu")


@dataclass
class Request:
    kv: RequestKv = field(default_factory=RequestKv)
    seq_len: int = 0


class Scheduler:
    """Drives SGLang's allocator the way its scheduler does for prefill, decode, window
    eviction and finish (the calls, not the policy)."""

    def __init__(self, allocator: Any, req_to_token: Any) -> None:
        self.allocator = allocator
        self.r2t = req_to_token

    def prefill(self, n: int) -> Request:
        req = Request()
        assert self.r2t.alloc([req]) is not None
        zero = torch.tensor([0])
        lens = torch.tensor([n])
        out = self.allocator.alloc_extend(zero, zero, lens, lens, torch.tensor([-1]), n)
        assert out is not None, "SGLang's allocator is out of pages"
        self.r2t.write((req.kv.req_pool_idx, slice(0, n)), out)
        req.seq_len = n
        req.kv.kv_allocated_len = n
        return req

    def decode(self, reqs: list[Request]) -> None:
        idx = [r.kv.req_pool_idx for r in reqs]
        last = torch.stack(
            [self.r2t.req_to_token[i, r.seq_len - 1] for i, r in zip(idx, reqs, strict=True)]
        )
        lens = torch.tensor([r.seq_len + 1 for r in reqs])
        out = self.allocator.alloc_decode(lens, lens, last.long())
        assert out is not None, "SGLang's allocator is out of pages"
        for i, r, loc in zip(idx, reqs, out.tolist(), strict=True):
            self.r2t.req_to_token[i, r.seq_len] = loc
            r.seq_len += 1
            r.kv.kv_allocated_len = r.seq_len

    def evict_window(self, req: Request) -> None:
        from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

        free_swa_out_of_window_slots(
            req,
            req.seq_len,
            sliding_window_size=WINDOW,
            page_size=PAGE,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.allocator,
            supports_prefix_sharing=False,
        )

    def evicted(self, req: Request) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import ComponentType

        return req.kv.get_evicted_seqlen(ComponentType.SWA)

    def finish(self, req: Request) -> None:
        from sglang.srt.mem_cache.common import free_kv_row_segments

        row = self.r2t.req_to_token[req.kv.req_pool_idx, : req.seq_len].long()
        free_kv_row_segments(self.allocator, [(row, 0)], swa_evicted_seqlen=self.evicted(req))
        self.r2t.free(req)


def unique_storages(root: Any) -> dict[tuple[str, int], int]:
    """Every tensor storage reachable from the pool, by (device, pointer): an independent
    sweep of the object graph (no depth limit, cycles cut)."""
    out: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            out[(str(obj.device), s.data_ptr())] = s.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("sglang", "accounting")):
            stack.extend(vars(obj).values())
    return out


def bridged(e: Any, backend: Any, *, name: str = "bridged", **pool_options: Any) -> Any:
    """The pool of `e` (a `kvledger.tools.bench.sglang_engine.Engine`) bridged, required, on
    `backend` (None: the bridge's CudaBackend), with a ledger of its own."""
    from accounting.ledger import Ledger
    from kvledger.engines.sglang.bridge import ENV_ENABLE, attach

    return attach(
        e.pool,
        Ledger({"model_name": name}),
        allocator=e.allocator,
        env={ENV_ENABLE: "1"},
        backend=backend,
        require=True,
        pool_options=pool_options,
    )
