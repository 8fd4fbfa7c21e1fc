"""Inventory of real SGLang 0.5.23 pools built on the CPU (marker `sglang`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from accounting import Ledger
from kvledger.engines.sglang.dsv4 import Knobs, plan
from kvledger.engines.sglang.inventory import register_pool
from kvledger.tools.bench.sglang_pool import Sizes, build_pool
from tests.kvledger.engines.sglang.dsv4.fixtures import flash, v41
from tests.kvledger.engines.sglang.rig import unique_storages

pytestmark = pytest.mark.sglang


def _build(shape: Any, knobs: Knobs, **extra: Any) -> tuple[Any, Any]:
    """SGLang's real pool for kvledger's buffer map of `shape` at 16,384 full tokens."""
    bm = plan(shape, knobs, full_tokens=16_384)
    s = bm.sizes
    sizes = Sizes(
        requests=s.max_running_requests,
        slots=s.num_req_slots,
        swa_tokens=s.swa_tokens,
        c4_tokens=s.c4_tokens,
        c128_tokens=s.c128_tokens,
        c4_state_size=s.c4_state_size,
        c128_state_size=s.c128_state_size,
        # V4.1's low-ratio pools are sized from it; V4 keeps SGLang's default.
        full_tokens=s.full_tokens if shape.has_low_ratios else None,
    )
    if shape.has_low_ratios:
        extra = {"kv_source_layers": list(shape.kv_source_layer_ids), **extra}
    pool = build_pool(
        sizes,
        ratios=list(shape.compress_ratios),
        layers=shape.num_hidden_layers,
        page=256,
        window=shape.sliding_window,
        device="cpu",
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        indexer_head_dim=shape.index_head_dim,
        kv_layout=bm.kv_layout,
        **extra,
    )
    return pool, bm


@pytest.fixture(params=["flash", "v41"])
def dsv4_pool(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    from tests.kvledger.engines.sglang.sglang_reference import published

    shape = flash() if request.param == "flash" else v41()
    with published(page_size=256):
        yield _build(shape, Knobs(max_running_requests=8))


def test_dsv4_pool_inventory_counts_each_storage_once(dsv4_pool: tuple[Any, Any]) -> None:
    pool, bm = dsv4_pool
    ledger = Ledger(labels={"model_name": "dsv4-flash-shape", "tp_rank": "0"})
    inv = register_pool(ledger, pool, name="dsv4")
    assert inv.kind == "dsv4"
    snap = ledger.snapshot()
    assert not snap.violations
    storages = unique_storages(pool)
    physical = snap.total("physical_bytes")
    assert physical > 0
    assert physical == sum(storages.values())
    assert physical == snap.total("tensor_bytes")
    assert len(inv.specs) == len(storages)
    # Aliased sub-pools (c4_kv_pool is kv_pools[4]) were not counted twice.
    assert pool.c4_kv_pool is pool.kv_pools[4]
    # Classified into the seven families (and V4.1's low-ratio ones), equal to kvledger's own
    # buffer map.
    fams = snap.rollup("family")
    assert set(k[0] for k in fams) == set(bm.families)
    for fam, fp in bm.families.items():
        assert fams[(fam,)]["tensor_bytes"] == fp.allocated_bytes, fam
    by_name = {s.name: s for s in inv.specs}
    for b in bm.buffers:
        spec = by_name[b.name]
        assert (spec.family, spec.layer, spec.shape, spec.dtype) == (
            b.family,
            b.layer,
            b.shape,
            b.dtype,
        )
    # The headline gauge's value is non-zero here, while SGLang's own figure reads 0.
    assert physical / 2**30 > 0
    assert pool.mem_usage == 0


def test_request_window_storage_is_accounted_under_its_own_families() -> None:
    """Encoder replay (SGLang's enable_encoder_swa_bounded_replay): no paged SWA pool; the
    request window's state is the SWA KV of every layer, beside its workspace and tags."""
    from tests.kvledger.engines.sglang.sglang_reference import published

    with published(
        page_size=256, enable_encoder_swa_bounded_replay=True, chunked_prefill_size=1024
    ):
        pool, bm = _build(v41(), Knobs(max_running_requests=8))
        rw = pool.request_window
        assert pool.swa_kv_pool is None and rw is not None
        ledger = Ledger()
        inv = register_pool(ledger, pool, name="dsv4")
        snap = ledger.snapshot()
        assert not snap.violations
        assert snap.total("physical_bytes") == sum(unique_storages(pool).values()) > 0
        fams = snap.rollup("family")
        assert "other" not in {k[0] for k in fams}
        state = rw.state.kv_buffer
        assert len(state) == bm.shape.num_hidden_layers
        # One window of `capacity` rows (256) per request slot plus a page, 528-byte tokens.
        assert rw.capacity == 256 and state[0].shape[1] == 256 * 528
        assert fams[("swa_kv",)]["tensor_bytes"] == sum(t.numel() for t in state)
        assert fams[("swa_kv",)]["capacity_slots"] == state[0].shape[0] * 256
        ws = rw.workspace.kv_buffer[0]
        assert fams[("swa_window_workspace",)]["tensor_bytes"] == ws.numel()
        assert fams[("swa_window_tags",)]["tensor_bytes"] == rw.tags.numel() * 8
        assert {s.layer for s in inv.specs if s.family == "swa_kv"} == set(
            range(bm.shape.num_hidden_layers)
        )
        # Everything else is what the paged pool would hold.
        for fam in ("c1_kv", "c2_kv", "c1_indexer", "c2_indexer", "c2_state", "c128_kv"):
            assert fams[(fam,)]["tensor_bytes"] == bm.families[fam].allocated_bytes, fam


def test_unified_kv_ring_is_accounted_as_unified_kv() -> None:
    """The unified-KV ring (SGLang's HIP unified_kv path, forced on the CPU): SWA ring rows
    and compressed rows in one tensor per layer, family unified_kv."""
    import sglang.srt.layers.attention.dsv4.unified_kv_gate as gate

    from tests.kvledger.engines.sglang.sglang_reference import published

    real = gate.is_unified_kv_triton
    gate.is_unified_kv_triton = lambda: True
    try:
        with published(page_size=256):
            pool, bm = _build(flash(), Knobs(max_running_requests=8))
    finally:
        gate.is_unified_kv_triton = real
    uk = pool.unified_kv_pool
    assert pool.swa_kv_pool is None and uk is not None
    ledger = Ledger()
    inv = register_pool(ledger, pool, name="dsv4")
    snap = ledger.snapshot()
    assert snap.total("physical_bytes") == sum(unique_storages(pool).values()) > 0
    fams = snap.rollup("family")
    assert "other" not in {k[0] for k in fams} and "swa_kv" not in {k[0] for k in fams}
    assert fams[("unified_kv",)]["tensor_bytes"] == sum(
        t.numel() * t.element_size() for t in uk.kv_buffer
    )
    # Rows: every request slot's SWA ring, then the compressed rows of the layer's ratio.
    slots = bm.sizes.num_req_slots
    assert uk.kv_buffer[0].shape == (slots * 128, 512)  # a Flash SWA-only layer, bf16
    assert {s.layer for s in inv.specs if s.family == "unified_kv"} == set(
        range(bm.shape.num_hidden_layers)
    )


def test_mha_and_swa_pools() -> None:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from tests.kvledger.engines.sglang.sglang_reference import published

    with published(page_size=16):
        mha = MHATokenToKVPool(
            size=1024,
            page_size=16,
            dtype=torch.bfloat16,
            head_num=4,
            head_dim=64,
            layer_num=3,
            device="cpu",
            enable_memory_saver=False,
        )
        ledger = Ledger()
        inv = register_pool(ledger, mha, name="mha")
        assert inv.kind == "mha"
        snap = ledger.snapshot()
        storages = unique_storages(mha)
        assert snap.total("physical_bytes") == sum(storages.values()) > 0
        fams = snap.rollup("family")
        # SGLang 0.5.23 allocates a layer's K and V as halves of one storage.
        assert fams[("kv",)]["tensor_bytes"] == 2 * 3 * (1024 + 16) * 4 * 64 * 2
        assert {s.layer for s in inv.specs if s.family == "kv"} == {0, 1, 2}

        swa = SWAKVPool(
            size=2048,
            size_swa=512,
            page_size=16,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=64,
            swa_attention_layer_ids=[0, 2],
            full_attention_layer_ids=[1],
            device="cpu",
        )
        ledger = Ledger()
        inv = register_pool(ledger, swa, name="swa")
        assert inv.kind == "swa"
        snap = ledger.snapshot()
        storages = unique_storages(swa)
        assert snap.total("physical_bytes") == sum(storages.values()) > 0
        fams = snap.rollup("family")
        assert fams[("swa_kv",)]["tensor_bytes"] == 2 * 2 * (512 + 16) * 2 * 64 * 2
        assert fams[("kv",)]["tensor_bytes"] == 2 * 1 * (2048 + 16) * 2 * 64 * 2
        assert {s.layer for s in inv.specs if s.family == "swa_kv"} == {0, 2}
        assert {s.layer for s in inv.specs if s.family == "kv"} == {1}


def test_hybrid_linear_pool_with_mamba_state() -> None:
    import torch
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    from tests.kvledger.engines.sglang.sglang_reference import published

    with published(page_size=16):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=256,
            n_groups=1,
            num_heads=4,
            head_dim=64,
            state_size=16,
            conv_kernel=4,
        )
        dtypes = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
        params = Mamba2CacheParams(shape=shape, dtype=dtypes, layers=[0, 2])
        mamba = MambaPool(
            size=4, spec_state_size=0, cache_params=params, mamba_layer_ids=[0, 2], device="cpu"
        )
        pool = HybridLinearKVPool(
            size=256,
            dtype=torch.bfloat16,
            page_size=16,
            head_num=2,
            head_dim=64,
            full_attention_layer_ids=[1],
            device="cpu",
            mamba_pool=mamba,
        )
        ledger = Ledger()
        inv = register_pool(ledger, pool, name="hybrid")
        assert inv.kind == "hybrid_linear"
        snap = ledger.snapshot()
        assert not snap.violations
        assert snap.total("physical_bytes") == sum(unique_storages(pool).values()) > 0
        fams = snap.rollup("family")
        cache = mamba.mamba_cache
        conv = sum(t.untyped_storage().nbytes() for t in cache.conv)
        assert fams[("mamba_conv",)]["physical_bytes"] == conv
        assert (
            fams[("mamba_temporal",)]["physical_bytes"] == cache.temporal.untyped_storage().nbytes()
        )
        assert fams[("mamba_temporal",)]["capacity_slots"] == cache.temporal.shape[1]
        # The full-attention layer keeps its global id (1), not its index in the sub-pool (0).
        assert {s.layer for s in inv.specs if s.family == "kv"} == {1}
