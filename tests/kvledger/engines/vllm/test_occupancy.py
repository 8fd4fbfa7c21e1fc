"""The engine-core side: vLLM's real KVCacheManager and BlockPool driven through allocate,
cache, free and evict; the ledger's figures equal the pool's own counts at every step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from accounting.ledger import Ledger
from accounting.request_slots import RequestSlots
from kvledger.engines.vllm.occupancy import (
    EVICTABLE_FAMILY,
    GROUP_EVICTABLE_PREFIX,
    SchedulerOccupancy,
    group_of_hash,
)
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
    from vllm.v1.core.kv_cache_utils import get_group_id

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
        # The group's cached blocks, in use and free, by the group their key names (vLLM's
        # own get_group_id), walked.
        cached = [b for b in pool.blocks if b.block_hash is not None and not b.is_null]
        mine = [b for b in cached if get_group_id(b.block_hash) == i]
        out[("protected", i)] = sum(1 for b in mine if b.ref_cnt > 0)
        out[("evictable", i)] = sum(1 for b in mine if b.ref_cnt == 0)
        assert {b.block_id for b in mine if b.ref_cnt > 0} <= held
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
    # Per group: its cached blocks in use are tree_protected, the rest of its slots in use
    # request_only; its free cached blocks its evictable account's, all tree_evictable.
    caching = occ.evictable is not None
    for g in occ.layouts:
        acc, per = by[g.family], g.slots_per_block
        protected = truth[("protected", g.index)] * per
        assert (acc.held_tree_protected, acc.held_tree_evictable) == (protected, 0), g.family
        assert acc.held_request_only == truth[g.index] - protected
        assert acc.held_unattributed == 0
        if caching:
            gev = by[GROUP_EVICTABLE_PREFIX + g.family]
            assert (
                gev.occupied_slots == gev.held_tree_evictable == truth[("evictable", g.index)] * per
            )
        else:
            assert GROUP_EVICTABLE_PREFIX + g.family not in by
    n = len(occ.layouts)
    assert sum(truth[("evictable", i)] for i in range(n)) == truth["evictable"]
    assert sum(truth[("protected", i)] for i in range(n)) == truth["protected"]
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


class _NoWalk(list):
    """The pool's block list, refusing any read: a publish must not touch it."""

    def __iter__(self):
        raise AssertionError("a publish walked the pool's blocks")

    def __getitem__(self, i):
        raise AssertionError(f"a publish read the pool's block {i!r}")

    def __len__(self):
        raise AssertionError("a publish measured the pool's blocks")


def _part(ledger: Ledger) -> RequestSlots:
    part = ledger.snapshot(reconcile=False).request_slots
    assert part is not None
    return part


class TestPublishedFootprints:
    @pytest.mark.parametrize("hybrid", [False, True], ids=["full", "full+sliding"])
    def test_each_refresh_publishes_the_running_requests(self, cfg, hybrid, tmp_path) -> None:
        from accounting.snapfile.head import load
        from accounting.snapfile.writer import Publisher

        specs = {**vs.full_specs(4), **(vs.sliding_specs(4) if hybrid else {})}
        manager = _manager(vs.kv_cache_config(cfg, specs, 8 << 20))
        ledger = Ledger({"engine_type": "vllm_scheduler"})
        running: list = []
        occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of, running=lambda: running)
        assert _part(ledger).running_requests == 0
        a = _request("a", list(range(100)))
        _run(a, manager)
        b = _request("b", list(range(100)) + [7] * 200)  # shares a's cached prefix
        assert _run(b, manager) > 0
        running += [a, b]
        occ.refresh()
        part = _part(ledger)
        assert part.running_requests == 2
        held = {r: _held_blocks(manager, r) for r in ("a", "b")}
        for i, (g, fam) in enumerate(zip(occ.layouts, part.families, strict=True)):
            assert fam.family == g.family
            assert fam.slots_sum == sum(h[i] for h in held.values()) * g.slots_per_block
            assert sum(fam.counts) == 2
        listed = {r.rid: r for r in part.requests}
        assert listed["b"].tokens == b.num_computed_tokens
        for rid, blocks in held.items():
            assert [listed[rid].slots_by_family[g.family] for g in occ.layouts] == [
                n * g.slots_per_block for n, g in zip(blocks, occ.layouts, strict=True)
            ]
        # A real file of it passes every check the exporter makes, and reads back equal.
        with Publisher(ledger, tmp_path, interval=60) as pub:
            data = Path(pub.path).read_bytes()
            name = pub.path.rsplit("/", 1)[1]
        assert load(data, name, time.time()).summary.request_slots == part
        manager.free(b)
        running.remove(b)
        occ.refresh()
        assert _part(ledger).running_requests == 1
        occ.close()
        assert ledger.snapshot(reconcile=False).request_slots is None

    def test_a_publish_reads_no_pool_block(self, cfg) -> None:
        """O(groups + running) beyond the blocks requests hold: holders per group and
        footprints come from counters and the requests' tables, never from the pool's
        blocks (refused here while a refresh and a snapshot run)."""
        specs = {**vs.full_specs(2), **vs.sliding_specs(2, start=2)}
        manager = _manager(vs.kv_cache_config(cfg, specs, 8 << 20))
        ledger = Ledger()
        running: list = []
        occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of, running=lambda: running)
        old = _request("old", list(range(64)))
        _run(old, manager)
        manager.free(old)  # its blocks cached, free: evictable, in each group
        r = _request("r", list(range(64)) + [5] * 100)  # a prefix hit on them
        assert _run(r, manager) > 0
        running.append(r)
        want = _truth(manager)
        blocks, manager.block_pool.blocks = manager.block_pool.blocks, _NoWalk()
        try:
            occ.refresh()
            snap = ledger.snapshot(reconcile=False)
        finally:
            manager.block_pool.blocks = blocks
        by = {a.family: a for a in snap.accounts}
        for g in occ.layouts:
            assert (
                by[g.family].held_tree_protected == want[("protected", g.index)] * g.slots_per_block
            )
        assert snap.request_slots is not None and snap.request_slots.running_requests == 1
        assert any(want[("protected", g.index)] for g in occ.layouts)
        assert any(want[("evictable", g.index)] for g in occ.layouts) or want["evictable"] == 0
        _agree(occ, ledger, manager)
        occ.close()


def test_group_of_hash() -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    for g in (0, 1, 7, 300, 2**31):
        assert group_of_hash(make_block_hash_with_group_id(BlockHash(b"\x01" * 32), g)) == g
    assert group_of_hash(b"ab") is None
    assert group_of_hash(object()) is None


def test_a_key_naming_no_group_turns_the_group_split_off(cfg) -> None:
    """A cached block whose key names a group the pool does not have: the groups' slots in
    use become unattributed (never split on a guess), the pool's holders stay read."""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    manager = _manager(vs.kv_cache_config(cfg, vs.full_specs(2), 4 << 20))
    ledger = Ledger()
    occ = SchedulerOccupancy(ledger, manager, kind_of=vs.kind_of)
    r = _request("r", list(range(64)))
    _run(r, manager)
    _agree(occ, ledger, manager)  # split per group while every key names group 0
    pool = manager.block_pool
    stray = pool.blocks[-1]  # a free block, never handed out
    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"z" * 32), 99), stray, None)
    occ.refresh()
    by = {a.family: a for a in ledger.snapshot(reconcile=False).accounts}
    (g,) = occ.layouts
    assert by[g.family].held_unattributed == by[g.family].occupied_slots > 0
    assert by[g.family].held_tree_protected == by[g.family].held_request_only == 0
    assert by["kv_pool"].held_unattributed == 0  # the pool's split does not need groups
    assert by[GROUP_EVICTABLE_PREFIX + g.family].occupied_slots == 0
    occ.close()
