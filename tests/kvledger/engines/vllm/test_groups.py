"""The worker side: vLLM's real KVCacheConfig and allocation, registered in a ledger."""

from __future__ import annotations

import pytest

from accounting.ledger import Ledger
from kvledger.engines.vllm.groups import POOL_FAMILY, layer_index, register_worker_cache
from tests.kvledger.engines.vllm import vllm_setup as vs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cfg():
    return vs.vllm_config()


def _check(ledger: Ledger, config, tensors) -> None:
    snap = ledger.snapshot(reconcile=False)
    storages = {
        (str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for t in tensors.values()
    }
    storage = sum(storages.values())
    # The storage counted once, whatever the number of groups aliasing it.
    assert snap.total("tensor_bytes") == storage
    assert snap.total("reserved_bytes") == storage
    assert snap.total("physical_bytes") == storage
    pool = [a for a in snap.accounts if a.family == POOL_FAMILY]
    assert len(pool) == 1 and pool[0].capacity_slots == config.num_blocks
    rows = {b.spec.name: b for b in snap.buffers}
    for i, group in enumerate(config.kv_cache_groups):
        acc = next(a for a in snap.accounts if a.family.startswith(f"g{i}_"))
        assert acc.capacity_slots == config.num_blocks * group.kv_cache_spec.block_size
        for name in group.layer_names:
            t = tensors[name]
            # What the group's view addresses: slot_bytes per token, times its tokens.
            assert rows[name].spec.slot_bytes * acc.capacity_slots == t.numel() * t.element_size()
            assert rows[name].spec.shape == tuple(t.shape)
    assert not snap.violations


def _view_bytes(snap) -> int:
    """What the groups' layer views address, all groups together."""
    return sum(
        b.spec.slot_bytes * b.spec.capacity_slots
        for b in snap.buffers
        if b.spec.family != POOL_FAMILY
    )


def test_one_group_of_full_attention(cfg) -> None:
    config = vs.kv_cache_config(cfg, vs.full_specs(4), 8 << 20)
    tensors = vs.allocate(cfg, config)
    assert len(config.kv_cache_groups) == 1
    ledger = Ledger()
    reg = register_worker_cache(ledger, config, tensors, kind_of=vs.kind_of)
    assert [a.family for a in reg.accounts] == [POOL_FAMILY, "g0_full_attention"]
    _check(ledger, config, tensors)
    # One storage, every layer a view into it: layers partition it exactly here.
    snap = ledger.snapshot(reconcile=False)
    views = _view_bytes(snap)
    assert views == snap.total("physical_bytes")
    reg.release(ledger)
    assert ledger.accounts() == ()
    assert ledger.snapshot(reconcile=False).total("physical_bytes") == 0


def test_hybrid_groups_alias_one_storage(cfg) -> None:
    specs = {**vs.full_specs(4), **vs.sliding_specs(4)}
    config = vs.kv_cache_config(cfg, specs, 8 << 20)
    tensors = vs.allocate(cfg, config)
    kinds = sorted(vs.kind_of(g.kv_cache_spec) for g in config.kv_cache_groups)
    assert kinds == ["full_attention", "sliding_window"]
    ledger = Ledger()
    reg = register_worker_cache(ledger, config, tensors, kind_of=vs.kind_of)
    _check(ledger, config, tensors)
    # The groups' views together address more than the storage: they alias it.
    snap = ledger.snapshot(reconcile=False)
    views = _view_bytes(snap)
    assert views > snap.total("physical_bytes")
    reg.release(ledger)
    assert ledger.accounts() == ()


def test_an_unknown_kind_is_reported_with_its_bytes(cfg) -> None:
    config = vs.kv_cache_config(cfg, vs.full_specs(2), 4 << 20)
    tensors = vs.allocate(cfg, config)
    ledger = Ledger()

    def refuse(spec):
        raise TypeError("a spec kvledger does not know")

    register_worker_cache(ledger, config, tensors, kind_of=refuse)
    snap = ledger.snapshot(reconcile=False)
    assert {a.family for a in snap.accounts} == {POOL_FAMILY, "g0_unknown"}
    assert snap.total("physical_bytes") == next(iter(tensors.values())).untyped_storage().nbytes()


def test_layer_index() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("lm_head") is None
