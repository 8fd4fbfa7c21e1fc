"""SGLang's own VMM-backed KV buffers (`KvVmmBufferOwner`, post-capture KV sizing) in the ledger
(marker `sglang`): reserved bytes are each buffer's virtual extent, physical and mapped bytes
its backed span, and after `post_capture_resize_kv_pool` (the plugin's AFTER hook) the figures
follow the final span. The owner is SGLang 0.5.23's own class with its own `_BufferSpec` and
`KvBufferDesc`; only its arena (a CUDA VMM reservation, which needs a GPU) is a stand-in holding
the granularity, the backed total and the MemPool id torch would report."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from accounting.buffers import Owner
from kvledger.engines.sglang import vmm_owner
from kvledger.engines.sglang.plugin import server_hooks
from kvledger.engines.sglang.plugin.rank import RankLedger

pytestmark = pytest.mark.sglang

GRAN = 2 << 20
LAYERS, TOKENS, ROW = 2, 4096, 1024  # a token row of 1 KiB: each buffer 4 MiB of extent
LABELS = {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


class NS(SimpleNamespace):
    pass


def _owner():
    from sglang.srt.mem_cache.kv_vmm_backing import KvVmmBufferOwner, _BufferSpec
    from sglang.srt.mem_cache.memory_pool import KvBufferDesc

    owner = object.__new__(KvVmmBufferOwner)
    owner.tensors = [torch.zeros(TOKENS, ROW, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    owner._specs = []
    for i, t in enumerate(owner.tensors):
        desc = KvBufferDesc(f"kv{i}", tuple(t.shape), row_bytes=ROW, tokens_per_row=1)
        span = desc.reserved_span_bytes(1)
        aligned = -(-span // GRAN) * GRAN + GRAN  # the extent rounded up, one granule more
        spec = _BufferSpec(desc, i * aligned, span, aligned)
        spec.backed_to = GRAN  # ensure_prefix(page_size): one granule before capture
        owner._specs.append(spec)
    owner._arena = NS(granularity=GRAN, pool=NS(id=(0, 7)))
    owner._arena.backed_bytes = sum(s.backed_to for s in owner._specs)
    return owner


def _pool(owner):
    return NS(
        k_buffer=owner.tensors[:LAYERS], v_buffer=owner.tensors[LAYERS:], _post_capture_owner=owner
    )


def _families(rank):
    snap = rank.ledger.snapshot()
    assert not snap.violations, snap.violations
    return {fam: figs for (fam, owner), figs in snap.rollup("family", "owner").items()}, snap


def test_vmm_backed_buffers_report_extent_as_reserved_and_backed_span_as_physical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = _owner()
    pool = _pool(owner)
    assert vmm_owner.arena_pool_ids(pool) == [(0, 7)]
    assert vmm_owner.backed_bytes(pool) == 2 * LAYERS * GRAN
    runner = NS(token_to_kv_pool=pool, token_to_kv_pool_allocator=None)
    with RankLedger(LABELS, directory=str(tmp_path), interval=60) as rank:
        rank.add_runner(runner)
        fams, snap = _families(rank)
        assert set(fams) == {"k", "v"}
        assert {b.spec.owner for b in snap.buffers} == {Owner.VMM}
        extent = owner._specs[0].aligned_reserved
        for figs in fams.values():
            assert figs["tensor_bytes"] == LAYERS * TOKENS * ROW
            assert figs["reserved_bytes"] == LAYERS * extent
            assert figs["physical_bytes"] == figs["mapped_bytes"] == LAYERS * GRAN

        # post_capture_resize_kv_pool -> finalize(): each buffer backed to its final span
        for spec in owner._specs:
            spec.backed_to = 3 * GRAN
        owner._arena.backed_bytes = sum(s.backed_to for s in owner._specs)
        monkeypatch.setattr(server_hooks, "_rank", rank)
        server_hooks.on_kv_resized(None, runner, draft_runners=())
        fams, _ = _families(rank)
        for figs in fams.values():
            assert figs["physical_bytes"] == figs["mapped_bytes"] == LAYERS * 3 * GRAN
        assert rank.ledger.snapshot().total("physical_bytes") == owner.backed_bytes
    assert rank.ledger.accounts() == ()  # closed: every page reported gone, accounts removed
