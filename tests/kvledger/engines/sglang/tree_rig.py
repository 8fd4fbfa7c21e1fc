"""SGLang 0.5.23's UnifiedRadixCache over the real DeepSeek-V4 pool, driven by requests that
share prefixes, on the CPU (tests marked `sglang` only).

`TreeScheduler` makes the calls a scheduler makes on the tree cache and the allocator:
`match_prefix` and `lock` at admission (the matched prefix written into the request's
row, the rest allocated by `alloc_extend`), `alloc_decode` per step, SWA window
eviction (`free_swa_out_of_window_slots` with prefix sharing), `insert` of the page-aligned
row with the lock moved onto the inserted node (as `checkpoint_into_tree` does), and at
finish the uncached tail freed (`free_kv_row_segments`), `unlock`, the row released;
`evict` through the tree's own `evict`. The tree core is SGLang's (its Rust core where
installed). The policy is the test's; every call is SGLang's.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.kvledger.engines.sglang import rig


def key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array.array("q", tokens))


def make_tree(alloc: Any, r2t: Any, *, disable: bool = False) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=disable,
        req_to_token_pool=r2t,
        token_to_kv_pool_allocator=alloc,
        page_size=rig.PAGE,
        sliding_window_size=rig.WINDOW,
        tree_components=(ComponentType.FULL, ComponentType.SWA),
    )
    return UnifiedRadixCache(params)


@dataclass
class Req:
    rid: str
    tokens: list[int]
    kv: rig.RequestKv = field(default_factory=rig.RequestKv)
    seq_len: int = 0
    lock: Any = None


class TreeScheduler:
    def __init__(self, alloc: Any, r2t: Any, tree: Any) -> None:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        self.alloc, self.r2t, self.tree = alloc, r2t, tree
        self.swa = ComponentType.SWA
        self.running: list[Req] = []
        self._next = 10_000

    # -- admission ------------------------------------------------------------------
    def admit(self, rid: str, prompt: list[int]) -> Req:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        m = self.tree.match_prefix(MatchPrefixParams(key=key(prompt)))
        p = int(m.device_prefix_len)
        req = Req(rid, list(prompt))
        req.lock = self.tree.lock(m.last_device_node)
        assert self.r2t.alloc([req]) is not None
        idx = req.kv.req_pool_idx
        n = len(prompt)
        last = -1
        if p:
            prefix = self.tree.path_device_indices(m.last_device_node)[:p]
            self.r2t.write((idx, slice(0, p)), prefix)
            last = int(prefix[-1])
        out = self.alloc.alloc_extend(
            torch.tensor([p]),
            torch.tensor([p]),
            torch.tensor([n]),
            torch.tensor([n]),
            torch.tensor([last]),
            n - p,
        )
        assert out is not None, "SGLang's allocator is out of pages"
        self.r2t.write((idx, slice(p, n)), out)
        req.seq_len = n
        req.kv.kv_allocated_len = n
        req.kv.cache_protected_len = p
        self.running.append(req)
        return req

    # -- decode and the window ------------------------------------------------------
    def decode(self, reqs: list[Req] | None = None) -> None:
        reqs = list(self.running if reqs is None else reqs)
        idx = [r.kv.req_pool_idx for r in reqs]
        last = torch.stack(
            [self.r2t.req_to_token[i, r.seq_len - 1] for i, r in zip(idx, reqs, strict=True)]
        )
        lens = torch.tensor([r.seq_len + 1 for r in reqs])
        out = self.alloc.alloc_decode(lens, lens, last.long())
        assert out is not None, "SGLang's allocator is out of pages"
        for i, r, loc in zip(idx, reqs, out.tolist(), strict=True):
            self.r2t.req_to_token[i, r.seq_len] = loc
            r.seq_len += 1
            r.kv.kv_allocated_len = r.seq_len
            r.tokens.append(self._next)
            self._next += 1

    def evict_window(self, req: Req) -> None:
        from sglang.srt.mem_cache import common

        # Looked up on the module at call time, as SGLang's own callers in common.py do.
        common.free_swa_out_of_window_slots(
            req,
            req.seq_len,
            sliding_window_size=rig.WINDOW,
            page_size=rig.PAGE,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            supports_prefix_sharing=True,
        )

    # -- the tree -------------------------------------------------------------------
    def checkpoint(self, req: Req) -> None:
        """Insert the request's page-aligned row; its lock moves onto the inserted node."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        aligned = req.seq_len // rig.PAGE * rig.PAGE
        if aligned <= req.kv.cache_protected_len:
            return
        idx = req.kv.req_pool_idx
        row = self.r2t.req_to_token[idx, :aligned].to(torch.int64, copy=True)
        result = self.tree.insert(
            InsertParams(
                key=key(req.tokens[:aligned]),
                value=row,
                prev_prefix_len=req.kv.cache_protected_len,
                component_evicted_seqlens={self.swa: req.kv.get_evicted_seqlen(self.swa)},
            )
        )
        node = result.last_device_node
        new = self.tree.path_device_indices(node)
        p = req.kv.cache_protected_len
        self.r2t.write((idx, slice(p, len(new))), new[p:])
        self.tree.unlock(req.lock)
        req.lock = self.tree.lock(node)
        req.kv.cache_protected_len = len(new)

    def finish(self, req: Req, *, cache: bool = True) -> None:
        from sglang.srt.mem_cache.common import free_kv_row_segments

        if cache:
            self.checkpoint(req)
        idx = req.kv.req_pool_idx
        p = req.kv.cache_protected_len
        tail = self.r2t.req_to_token[idx, p : req.seq_len].to(torch.int64)
        if tail.numel():
            free_kv_row_segments(
                self.alloc, [(tail, p)], swa_evicted_seqlen=req.kv.get_evicted_seqlen(self.swa)
            )
        self.tree.unlock(req.lock)
        req.lock = None
        self.r2t.free(req)
        self.running.remove(req)

    def evict(self, full_tokens: int, swa_tokens: int = 0) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.tree.evict(EvictParams(num_tokens=full_tokens, swa_num_tokens=swa_tokens))

    # -- what the test expects, counted from the requests alone -----------------------
    def request_only_full_tokens(self) -> int:
        """Full-space tokens the running requests hold outside the tree: each one's
        allocated pages past its protected (tree-owned) prefix."""
        return sum(
            -(-r.seq_len // rig.PAGE) * rig.PAGE - r.kv.cache_protected_len for r in self.running
        )
