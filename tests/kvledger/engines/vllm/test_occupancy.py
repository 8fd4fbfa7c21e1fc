"""The engine-core side: vLLM's real KVCacheManager and BlockPool driven through allocate,
cache, free and evict; the ledger's figures equal the pool's own counts at every step."""

from __future__ import annotations

import pytest

from accounting.ledger import Ledger
from kvledger.engines.vllm.occupancy import EVICTABLE_FAMILY, SchedulerOccupancy
from tests.kvledger.engines.vllm import vllm_setup as vs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cfg():
    return vs.vllm_config()


def _manager(config, caching: bool = True):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=vs.BLOCK,
        hash_block_size=vs.BLOCK,
        enable_caching=caching,
    )


def _request(rid: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(vs.BLOCK, sha256),
    )


def _truth(manager) -> dict[object, int]:
    """The pool's state walked block by block (what kvledger must not do per step)."""
    pool = manager.block_pool
    free = pool.get_num_free_blocks()
    out: dict[object, int] = {
        "in_use": pool.num_gpu_blocks - free,
        "evictable": sum(
            1 for b in pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None
        ),
    }
    out["protected"] = sum(
        1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null and b.block_hash is not None
    )
    null = pool.null_block
    for i, m in enumerate(manager.coordinator.single_type_managers):
        # Distinct blocks: one shared by several requests (a prefix hit) counts once.
        held = {b.block_id for blocks in m.req_to_blocks.values() for b in blocks if b is not null}
        out[i] = len(held) * m.block_size
        out[("blocks", i)] = len(held)
    # Every block in use but the null block is held by some request, in one group.
    n = len(manager.coordinator.single_type_managers)
    assert sum(out[("blocks", i)] for i in range(n)) == out["in_use"] - 1
    return out


def _agree(occ: SchedulerOccupancy, ledger: Ledger, manager) -> dict[object, int]:
    occ.refresh()
    truth = _truth(manager)
    snap = ledger.snapshot(reconcile=False)
    by = {a.family: a for a in snap.accounts}
    assert by["kv_pool"].occupied_slots == truth["in_use"]
    assert by[EVICTABLE_FAMILY].occupied_slots == truth["evictable"]
    for g in occ.layouts:
        assert by[g.family].occupied_slots == truth[g.index], g.family
    # Holders: of the blocks in use, the cached ones are tree_protected, the rest (the null
    # block among them) request_only; the evictable blocks are their own account's.
    pool = by["kv_pool"]
    assert (pool.held_tree_protected, pool.held_tree_evictable) == (truth["protected"], 0)
    assert pool.held_request_only == truth["in_use"] - truth["protected"]
    assert pool.held_unattributed == 0
    ev = by[EVICTABLE_FAMILY]
    assert (ev.held_tree_evictable, ev.held_request_only) == (truth["evictable"], 0)
    assert not snap.violations
    return truth


def _run(req, manager):
    computed, n = manager.get_computed_blocks(req)[:2]
    got = manager.allocate_slots(req, req.num_tokens - n, n, computed)
    assert got is not None
    req.num_computed_tokens = req.num_tokens
    return n


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "full+sliding"])
def test_figures_follow_the_pool(cfg, hybrid: bool) -> None:
    specs = {**vs.full_specs(4), **(vs.sliding_specs(4) if hybrid else {})}
    config = vs.kv_cache_config(cfg, specs, 8 << 20)
    manager = _manager(config)
    ledger = Ledger()
    occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of)
    t = _agree(occ, ledger, manager)
    assert t["in_use"] == 1  # the null block, held for good
    a = _request("a", list(range(100)))
    _run(a, manager)
    t = _agree(occ, ledger, manager)
    assert t["in_use"] > 1
    manager.free(a)  # its full blocks stay cached: evictable
    t = _agree(occ, ledger, manager)
    assert t["evictable"] > 0  # its full blocks, cached, now free
    b = _request("b", list(range(100)) + [7] * 20)  # a prefix hit: cached blocks touched
    hit = _run(b, manager)
    assert hit > 0
    t = _agree(occ, ledger, manager)
    assert t["protected"] > 0  # b holds the cached prefix it hit
    # Another request hits b's prefix while b runs: the shared blocks count once per group.
    c = _request("c", list(range(100)) + [9] * 20)
    assert _run(c, manager) > 0
    before = t
    t = _agree(occ, ledger, manager)
    new_blocks = t["in_use"] - before["in_use"]
    assert new_blocks < sum(
        len(m.req_to_blocks["c"]) for m in manager.coordinator.single_type_managers
    )
    manager.free(c)
    manager.free(b)
    _agree(occ, ledger, manager)
    # Fill the pool with fresh prompts: cached blocks are evicted as they are reused.
    fill = []
    for i in range(50):
        r = _request(f"f{i}", [1000 + i] * 64)
        computed, n = manager.get_computed_blocks(r)[:2]
        if manager.allocate_slots(r, r.num_tokens - n, n, computed) is None:
            break
        r.num_computed_tokens = r.num_tokens
        fill.append(r)
        _agree(occ, ledger, manager)
    assert fill
    manager.evict_blocks({blk.block_id for blk in manager.block_pool.blocks[1:20]})
    _agree(occ, ledger, manager)
    for r in fill:
        manager.free(r)
    _agree(occ, ledger, manager)
    assert manager.reset_prefix_cache()
    t = _agree(occ, ledger, manager)
    assert t["evictable"] == 0 and t["in_use"] == 1
    # Release: the pool's methods are vLLM's own again, the accounts gone.
    occ.close()
    occ.close()
    assert "append_n" not in vars(manager.block_pool.free_block_queue)
    assert "evict_blocks" not in vars(manager.block_pool)
    assert "_insert_block_hash" not in vars(manager.block_pool)
    assert ledger.accounts() == ()


def test_without_prefix_caching_nothing_is_wrapped(cfg) -> None:
    config = vs.kv_cache_config(cfg, vs.full_specs(2), 2 << 20)
    manager = _manager(config, caching=False)
    ledger = Ledger()
    occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of)
    assert occ.evictable is None
    r = _request("a", list(range(40)))
    _run(r, manager)
    _agree(occ, ledger, manager)
    manager.free(r)
    assert _agree(occ, ledger, manager)["evictable"] == 0
    occ.close()


def _held_blocks(manager, rid: str) -> list[int]:
    """A request's non-null blocks per group, walked (the truth footprints are held to)."""
    null = manager.block_pool.null_block
    return [
        sum(1 for b in m.req_to_blocks.get(rid, ()) if b is not null)
        for m in manager.coordinator.single_type_managers
    ]


class _NoIter(list):
    """A request's block list that refuses a walk: footprints must bisect, not iterate."""

    def __iter__(self):
        raise AssertionError("footprints walked a request's blocks")


class TestFootprints:
    @pytest.mark.parametrize("hybrid", [False, True], ids=["full", "full+sliding"])
    def test_blocks_per_group_match_the_managers(self, cfg, hybrid: bool) -> None:
        specs = {**vs.full_specs(4), **(vs.sliding_specs(4) if hybrid else {})}
        manager = _manager(vs.kv_cache_config(cfg, specs, 8 << 20))
        ledger = Ledger()
        occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of)
        a = _request("a", list(range(100)))
        _run(a, manager)
        b = _request("b", list(range(100)) + [7] * 200)  # a prefix hit on a's blocks
        assert _run(b, manager) > 0
        if hybrid:  # the sliding window's blocks before the window become null blocks
            for m in manager.coordinator.single_type_managers:
                m.remove_skipped_blocks("b", b.num_computed_tokens)
        idle = _request("idle", [1, 2, 3])  # running, no blocks yet
        got = occ.footprints([a, b, idle])
        assert [f.rid for f in got] == ["a", "b", "idle"]
        for f, req in zip(got, (a, b, idle), strict=True):
            assert list(f.blocks) == _held_blocks(manager, req.request_id)
            assert f.tokens == req.num_computed_tokens
            assert f.slots == tuple(
                n * g.slots_per_block for n, g in zip(f.blocks, occ.layouts, strict=True)
            )
        assert got[2].blocks == (0,) * len(occ.layouts)
        # Reading created no entry in vLLM's tables.
        assert all("idle" not in m.req_to_blocks for m in manager.coordinator.single_type_managers)
        if hybrid:
            window = manager.coordinator.single_type_managers[1].req_to_blocks["b"]
            assert window[0] is manager.block_pool.null_block  # there were nulls to skip
        # Shared blocks count in each request that holds them: a and b both count the
        # prefix, so together they exceed the group's occupied slots.
        occ.refresh()
        snap = {x.family: x for x in ledger.snapshot(reconcile=False).accounts}
        g0 = occ.layouts[0]
        assert got[0].slots[0] + got[1].slots[0] > snap[g0.family].occupied_slots
        assert got[1].slots[0] <= snap[g0.family].occupied_slots
        occ.close()

    def test_reads_no_request_list_and_no_pool_block(self, cfg) -> None:
        """O(running): a request's list is bisected (never iterated) and the pool's blocks
        are not touched."""
        specs = {**vs.full_specs(2), **vs.sliding_specs(2, start=2)}
        manager = _manager(vs.kv_cache_config(cfg, specs, 8 << 20))
        ledger = Ledger()
        occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of)
        r = _request("r", list(range(300)))
        _run(r, manager)
        for m in manager.coordinator.single_type_managers:
            m.remove_skipped_blocks("r", r.num_computed_tokens)
        want = _held_blocks(manager, "r")
        for m in manager.coordinator.single_type_managers:
            m.req_to_blocks["r"] = _NoIter(m.req_to_blocks["r"])
        pool_blocks, manager.block_pool.blocks = manager.block_pool.blocks, None
        try:
            (f,) = occ.footprints([r])
        finally:
            manager.block_pool.blocks = pool_blocks
        assert list(f.blocks) == want and want[1] < want[0]  # the window dropped blocks
        occ.close()
