"""SGLang 0.5.23's DeepSeek-V4 KV pool and SWA allocator, driven the way its scheduler drives them.

`Engine` builds SGLang's own `DeepSeekV4TokenToKVPool`, `ReqToTokenPool` and
`SWATokenToKVPoolAllocator` on one device and runs the calls SGLang's
scheduler makes for a request's life: prefill (`alloc_extend`), a batched
decode step (`alloc_decode` and the request-to-token writes), sliding-window
eviction (`free_swa_out_of_window_slots` for every request that is due, inside
one free group, as `ScheduleBatch.maybe_evict_swa` does) and finish
(`free_kv_row_segments`). The calls are SGLang's; only the policy (which
request, when) is the caller's.

`RequestKv` stands in for SGLang's `ReqKvInfo`, whose module
(`managers.schedule_batch`) pulls in the OpenAI client and more than a light
install carries: it has the fields those free paths read.

Importing this module needs neither sglang nor a GPU; `Engine` and `published`
import sglang when called.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvledger.tools.bench.sglang_pool import Sizes, build_allocator, build_pool, build_req_to_token

if TYPE_CHECKING:
    from accounting.ledger import Account, Ledger

PAGE = 256  # DeepSeek-V4's page in SGLang (forced)
WINDOW = 128  # DeepSeek-V4's sliding window
# DeepSeek-V4's compression ratio per layer (0: SWA only), repeated for `layers`.
RATIO_PATTERN = (0, 0, 4, 128)


def ratios(layers: int) -> list[int]:
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r}, expected a positive int")
    return [RATIO_PATTERN[i % len(RATIO_PATTERN)] for i in range(layers)]


@contextlib.contextmanager
def published(page_size: int = PAGE) -> Iterator[None]:
    """A ServerArgs for DeepSeek-V4 published in SGLang's runtime context (its pools read
    it), reset afterwards."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", page_size=page_size, swa_full_tokens_ratio=0.1)
    reset_context()
    publish(args, role="kvledger-bench", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield
    finally:
        reset_context()


class RequestKv:
    """The fields of SGLang 0.5.23's ReqKvInfo that its SWA free paths read."""

    def __init__(self) -> None:
        self.req_pool_idx: int | None = None
        self.cache_protected_len = 0
        self.swa_evict_floor = 0
        self.kv_allocated_len = 0
        self._evicted: dict[Any, int] = {}

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    def swa_dead_lo(self, page_size: int) -> int:
        return max(self.cache_protected_len, self.swa_evict_floor)

    def get_evicted_seqlen(self, component_type: Any) -> int:
        return self._evicted.get(component_type, 0)

    def set_evicted_seqlen(self, component_type: Any, length: int) -> None:
        self._evicted[component_type] = length


_RIDS = itertools.count()


@dataclass
class Request:
    kv: RequestKv = field(default_factory=RequestKv)
    rid: str = field(default_factory=lambda: f"bench-{next(_RIDS)}")  # as SGLang's Req has
    seq_len: int = 0
    decoded: int = 0


@dataclass(frozen=True)
class Shape:
    """Sizes of one engine: `swa_pages` SWA pages (plus SGLang's padding page 0),
    `full_pages` pages of the (logical) full-token space, `requests` request slots of up to
    `max_context` tokens each."""

    layers: int
    swa_pages: int
    full_pages: int
    requests: int
    max_context: int

    def __post_init__(self) -> None:
        for name in ("layers", "swa_pages", "full_pages", "requests", "max_context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Shape.{name}={v!r}, expected a positive int")
        if self.max_context % PAGE:
            raise ValueError(f"Shape.max_context={self.max_context}, expected a multiple of {PAGE}")


class Engine:
    """One SGLang DeepSeek-V4 pool, its request-to-token pool and its SWA allocator."""

    def __init__(self, shape: Shape, device: str = "cpu") -> None:
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import ComponentType
        from sglang.srt.mem_cache.common import free_kv_row_segments, free_swa_out_of_window_slots

        self._torch = torch
        self._swa_component = ComponentType.SWA
        self._free_window = free_swa_out_of_window_slots
        self._free_rows = free_kv_row_segments
        self.shape = shape
        self.device = device
        rs = ratios(shape.layers)
        full = shape.full_pages * PAGE
        sizes = Sizes.from_pages(
            requests=shape.requests,
            swa_pages=shape.swa_pages,
            full_pages=shape.full_pages,
            page=PAGE,
        )
        self.pool = build_pool(sizes, ratios=rs, page=PAGE, window=WINDOW, device=device)
        self.r2t = build_req_to_token(shape.requests, shape.max_context, device)
        self.allocator = build_allocator(
            self.pool, self.r2t, full_tokens=full, page=PAGE, device=device
        )
        if device == "cpu":
            pin_torch_native(self.allocator)
        self.swa = self.allocator.swa_attn_allocator
        self.running: list[Request] = []

    # -- what SGLang holds ---------------------------------------------------------------------
    @property
    def swa_rows(self) -> int:
        """Rows of each SWA buffer: every page SGLang hands out plus its padding page 0."""
        return int(self.swa.num_pages) + 1

    def held_swa_pages(self) -> int:
        return int(self.swa.num_pages) - int(self.swa.available_size()) // PAGE

    def swa_pages_of(self, req: Request, start: int = 0) -> list[int]:
        """The SWA pages behind tokens [start, seq_len) of `req` (0 where evicted)."""
        row = self.r2t.req_to_token[req.kv.req_pool_idx, start : req.seq_len].long()
        swa = self.allocator.translate_loc_from_full_to_swa(row)
        return sorted({int(p) for p in (swa // PAGE).tolist()} - {0})

    # -- the scheduler's calls -------------------------------------------------------------------
    def prefill(self, n: int) -> Request:
        """Admit one request with an `n`-token prompt (no shared prefix)."""
        torch = self._torch
        if not 0 < n <= self.shape.max_context:
            raise ValueError(f"prefill: n={n!r}, expected 1..{self.shape.max_context}")
        req = Request()
        if self.r2t.alloc([req]) is None:
            raise RuntimeError("prefill: no request slot left (SGLang's ReqToTokenPool is full)")
        zero_cpu = torch.zeros(1, dtype=torch.int64)
        lens_cpu = torch.tensor([n], dtype=torch.int64)
        dev = self.device
        out = self.allocator.alloc_extend(
            zero_cpu.to(dev),
            zero_cpu,
            lens_cpu.to(dev),
            lens_cpu,
            torch.tensor([-1], dtype=torch.int64, device=dev),
            n,
        )
        if out is None:
            self.r2t.free(req)
            raise RuntimeError(f"prefill: SGLang's allocator is out of pages for {n} tokens")
        self.r2t.write((req.kv.req_pool_idx, slice(0, n)), out)
        req.seq_len = n
        req.kv.kv_allocated_len = n
        self.running.append(req)
        return req

    def _to_dev(self, t: Any) -> Any:
        """A host tensor on the engine's device, as the scheduler's calls take it."""
        return t.to(self.device)

    def decode(self) -> None:
        """One decode step of every running request: one token each."""
        self.decode_some(self.running)

    def decode_some(self, reqs: list[Request]) -> None:
        """One decode step of `reqs`: one token each."""
        torch = self._torch
        if not reqs:
            return
        idx = self._to_dev(torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64))
        pos_cpu = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        pos = self._to_dev(pos_cpu)
        last = self.r2t.req_to_token[idx, pos - 1].long()
        lens_cpu = pos_cpu + 1
        out = self.allocator.alloc_decode(self._to_dev(lens_cpu), lens_cpu, last)
        if out is None:
            raise RuntimeError("decode: SGLang's allocator is out of pages")
        self.r2t.req_to_token[idx, pos] = out.to(torch.int32)
        for r in reqs:
            r.seq_len += 1
            r.decoded += 1
            r.kv.kv_allocated_len = r.seq_len

    def evict_windows(self, reqs: list[Request] | None = None) -> None:
        """Free the SWA pages that left the window of each request of `reqs` (default: every
        running one) that is due, in one free group, as SGLang's decode step does."""
        swa = self._swa_component
        due = [
            r
            for r in (self.running if reqs is None else reqs)
            if r.seq_len - 1 - WINDOW >= r.kv.get_evicted_seqlen(swa) + 1
        ]
        if not due:
            return
        self.allocator.free_group_begin()
        try:
            for r in due:
                self._free_window(
                    r,
                    r.seq_len - 1,
                    sliding_window_size=WINDOW,
                    page_size=PAGE,
                    req_to_token_pool=self.r2t,
                    token_to_kv_pool_allocator=self.allocator,
                    supports_prefix_sharing=False,
                )
        finally:
            self.allocator.free_group_end()

    def finish(self, req: Request) -> None:
        row = self.r2t.req_to_token[req.kv.req_pool_idx, : req.seq_len].long()
        evicted = req.kv.get_evicted_seqlen(self._swa_component)
        self._free_rows(self.allocator, [(row, 0)], swa_evicted_seqlen=evicted)
        self.r2t.free(req)
        self.running.remove(req)

    def finish_all(self) -> None:
        for r in list(self.running):
            self.finish(r)

    def sync(self) -> None:
        if self.device != "cpu":
            self._torch.cuda.synchronize(self.device)


def attach_bridge(
    engine: Engine, ledger: Ledger, pool_options: dict[str, Any] | None = None
) -> Any:
    """kvledger's bridge attached to `engine`'s pool and allocator (enabled, required)."""
    from kvledger.engines.sglang.bridge import ENV_ENABLE, attach

    return attach(
        engine.pool,
        ledger,
        allocator=engine.allocator,
        env={ENV_ENABLE: "1"},
        require=True,
        pool_options=pool_options,
    )


def swa_vmm_account(ledger: Ledger) -> Account:
    """The ledger's account of the bridged swa_kv family (its map and unmap totals)."""
    from accounting.buffers import Owner

    return next(a for a in ledger.accounts() if a.family == "swa_kv" and a.owner is Owner.VMM)


def pin_torch_native(allocator: Any) -> None:
    """Make SGLang's paged allocators of a CPU pool run their torch-native paths.

    SGLang picks its allocator kernels by platform, not by the pool's device: where CUDA
    is present, `PagedTokenToKVPoolAllocator.use_triton_kernels` is True even for a CPU
    pool, and its Triton kernels cannot take CPU tensors. On a CPU-only platform it is
    False; this sets what SGLang would choose there."""
    for name in ("full_attn_allocator", "swa_attn_allocator"):
        sub = getattr(allocator, name, None)
        if sub is not None and hasattr(sub, "use_triton_kernels"):
            sub.use_triton_kernels = False
