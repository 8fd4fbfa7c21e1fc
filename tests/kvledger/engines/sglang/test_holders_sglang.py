# mypy: disable-error-code="union-attr"
"""Holders read from SGLang 0.5.23's real tree cache, allocator and request pool (marker `sglang`).

A trace of requests sharing prefixes runs through SGLang's UnifiedRadixCache over its
DeepSeek-V4 pool and SWATokenToKVPoolAllocator (tests/kvledger/engines/sglang/tree_rig.py). At
every step, in every family: the holders add up to occupied (no violation), the
protected and evictable slots are the tree's own sizes converted to the family's slots,
occupied is SGLang's own count converted, and request_only in the full-space families
equals what the running requests hold past their tree-owned prefixes (counted from the
requests alone). The same with the SWA family on kvledger's VMM pool (the bridge).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from accounting.figures import Held
from accounting.ledger import Ledger
from kvledger.engines.sglang.holders import (
    FULL,
    REQ,
    SWA,
    HolderReader,
    Pressure,
    dsv4_units,
)
from kvledger.engines.sglang.inventory import register_pool
from tests.kvledger.engines.sglang import rig
from tests.kvledger.engines.sglang.tree_rig import TreeScheduler, make_tree

pytestmark = pytest.mark.sglang
PAGE = rig.PAGE


class World:
    def __init__(
        self, *, bridge: Any = None, disable: bool = False, pressure: Pressure | None = None
    ) -> None:
        self.pool = rig.make_pool()
        self.r2t = rig.make_req_to_token()
        self.alloc = rig.make_allocator(self.pool, self.r2t)
        self.tree = make_tree(self.alloc, self.r2t, disable=disable)
        self.ledger = Ledger({"model_name": "holders"})
        self.bridge = None
        if bridge is not None:
            from kvledger.engines.sglang.bridge import ENV_ENABLE, attach

            self.bridge = attach(
                self.pool,
                self.ledger,
                allocator=self.alloc,
                env={ENV_ENABLE: "1"},
                backend=bridge,
                require=True,
                pool_name="dsv4",
            )
        else:
            register_pool(self.ledger, self.pool, name="dsv4")
        self.accounts = {a.family: a for a in self.ledger.accounts() if a.pool == "dsv4"}
        self.units = dsv4_units(self.pool)
        self.pressure = Pressure() if pressure is None else pressure
        self.s = TreeScheduler(self.alloc, self.r2t, self.tree)
        self.reader = HolderReader(
            self.ledger,
            self.accounts,
            tree=self.tree,
            allocator=self.alloc,
            req_to_token=self.r2t,
            units=self.units,
            bridged={f for f, a in self.accounts.items() if a.owner.value == "vmm"},
            running=lambda: self.s.running,
            pressure=self.pressure,
            sync=self.bridge.flush if self.bridge is not None else None,
        )
        self.seen: dict[str, set[str]] = {}

    def close(self) -> None:
        self.reader.close()
        if self.bridge is not None:
            self.bridge.detach()

    def check(self, tag: str) -> None:
        """Every relation, per family, against SGLang's own counts."""
        snap = self.ledger.snapshot()
        assert not snap.violations, (tag, snap.violations)
        a = self.alloc
        counts = {
            FULL: a.size_full - a.full_available_size(),
            SWA: a.size_swa - a.swa_available_size(),
            REQ: self.r2t.size - self.r2t.available_size(),
        }
        tree = {
            FULL: (self.tree.full_protected_size(), self.tree.full_evictable_size()),
            SWA: (self.tree.swa_protected_size(), self.tree.swa_evictable_size()),
            REQ: (0, 0),
        }
        for row in snap.accounts:
            if row.family == "other":  # storages no family claims: no slots
                assert row.occupied_slots == 0 and row.held == Held()
                continue
            u = self.units[row.family]
            held = row.held
            assert held.total() == row.occupied_slots, (tag, row.family)
            assert row.occupied_slots == u.of(counts[u.space]), (tag, row.family)
            protected, evictable = tree[u.space]
            assert (held.tree_protected, held.tree_evictable) == (
                u.of(protected),
                u.of(evictable),
            ), (tag, row.family)
            assert held.unattributed == 0
            if u.space == FULL:
                assert held.request_only == u.of(self.s.request_only_full_tokens()), (
                    tag,
                    row.family,
                )
            for name, v in held.to_dict().items():
                if v:
                    self.seen.setdefault(row.family, set()).add(name)
        state = snap.engine
        assert state is not None and state.holders_from == "UnifiedRadixCache"
        assert state.running_requests == len(self.s.running)


def trace(w: World) -> None:
    """Three sessions share a 512-token system prompt; a second turn reuses its first;
    the tree evicts; windows slide."""
    s = w.s
    system = list(range(1, 2 * PAGE + 1))
    w.check("empty")
    a = s.admit("a", system + list(range(5000, 5100)))
    w.check("a admitted")
    for _ in range(40):
        s.decode()
    s.evict_window(a)
    w.check("a decoded, window slid")
    s.checkpoint(a)  # cache_unfinished_req: a's prompt pages join the tree, locked by a
    w.check("a checkpointed")
    b = s.admit("b", system + list(range(7000, 7300)))  # shares the system prompt with a
    assert b.kv.cache_protected_len == 2 * PAGE
    w.check("b admitted on a's prefix")
    for _ in range(30):
        s.decode()
        s.evict_window(a)
        s.evict_window(b)
    w.check("a and b decoding")
    a_turn = list(a.tokens)
    s.finish(a)  # a's prefix stays locked by b; its own tail becomes evictable
    w.check("a finished")
    c = s.admit("c", a_turn + list(range(9000, 9050)))  # a's second turn
    assert c.kv.cache_protected_len >= 2 * PAGE
    w.check("c admitted on a's turn")
    s.finish(b)
    s.finish(c)
    w.check("all finished")
    got = s.evict(full_tokens=PAGE)
    assert got.num_tokens_evicted >= PAGE
    w.check("tree evicted")
    d = s.admit("d", [*system, 1])
    w.check("d admitted")
    s.finish(d, cache=False)
    w.check("d finished uncached")


@pytest.fixture
def world() -> Iterator[World]:
    with rig.published():
        w = World()
        try:
            yield w
        finally:
            w.close()


def test_holders_add_up_and_equal_the_trees_own_sizes_at_every_step(world: World) -> None:
    trace(world)
    for family in ("c4_kv", "c128_kv", "c4_indexer", "swa_kv"):
        assert world.seen[family] >= {"tree_protected", "tree_evictable", "request_only"}, family
    assert world.seen["c128_state"] == {"request_only"}


def test_the_same_with_the_swa_family_on_kvledgers_vmm_pool() -> None:
    from allocator.host import HostBackend

    with rig.published():
        w = World(bridge=HostBackend())
        try:
            assert w.accounts["swa_kv"].owner.value == "vmm"
            trace(w)
            assert w.seen["swa_kv"] >= {"tree_protected", "tree_evictable", "request_only"}
        finally:
            w.close()


def test_tree_and_window_evictions_are_counted_apart_per_family() -> None:
    """Through the plugin's hook functions around SGLang's own calls (the AROUND wrapper of
    free_swa_out_of_window_slots, the AFTER hook of UnifiedRadixCache._evict), into the
    process's pressure totals, converted per family by the reader."""
    import functools

    from sglang.srt.mem_cache import common

    from kvledger.engines.sglang.holders import PRESSURE
    from kvledger.engines.sglang.plugin import server_hooks

    with rig.published():
        w = World(pressure=PRESSURE)
        try:
            s = w.s
            window0, tree0 = PRESSURE.window_swa_tokens, PRESSURE.tree_full_tokens
            wrapped = functools.partial(
                server_hooks.count_window_eviction, common.free_swa_out_of_window_slots
            )
            a = s.admit("a", list(range(1, 3 * PAGE + 1)))
            for _ in range(10):
                s.decode()
            before = a.kv.get_evicted_seqlen(s.swa)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(common, "free_swa_out_of_window_slots", wrapped)
                s.evict_window(a)  # looks the function up on the module: the wrapper
            window = PRESSURE.window_swa_tokens - window0
            assert window == a.kv.get_evicted_seqlen(s.swa) - before >= PAGE
            s.finish(a)
            result = s.evict(full_tokens=PAGE)
            server_hooks.count_tree_eviction(result, w.tree)  # the AFTER hook: (result, self)
            assert PRESSURE.tree_full_tokens - tree0 == result.num_tokens_evicted >= PAGE
            rows = {r.family: r for r in w.ledger.snapshot().accounts}
            assert rows["swa_kv"].window_evicted_slots_total == window
            assert rows["c4_attn_state"].window_evicted_slots_total == window * 8 // PAGE
            assert rows["c4_kv"].evicted_slots_total == result.num_tokens_evicted // 4
            assert rows["c128_kv"].evicted_slots_total == result.num_tokens_evicted // 128
            assert rows["c4_kv"].window_evicted_slots_total == 0
            assert rows["swa_kv"].evicted_slots_total == result.swa_num_tokens_evicted
            assert rows["c128_state"].evicted_slots_total == 0
        finally:
            w.close()


def test_per_request_footprints_name_who_holds_the_swa_family(world: World) -> None:
    s = world.s
    big = s.admit("big", list(range(1, 3 * PAGE)))
    small = s.admit("small", list(range(9000, 9010)))
    state = world.ledger.snapshot().engine
    assert [r.rid for r in state.requests] == ["big", "small"]
    top = state.requests[0]
    slot = {f: sum(b.slot_bytes for b in a.buffers) for f, a in world.accounts.items()}
    assert top.tokens == big.seq_len
    assert top.bytes_by_family["c4_kv"] == big.seq_len // 4 * slot["c4_kv"]
    assert top.bytes_by_family["swa_kv"] == big.seq_len * slot["swa_kv"]
    assert top.bytes_by_family["c128_state"] == 128 * slot["c128_state"]
    assert top.bytes == sum(top.bytes_by_family.values())
    assert state.running_requests == 2 and sum(state.request_bytes_counts) == 2
    s.finish(small, cache=False)


def test_a_disabled_radix_cache_leaves_every_slot_with_requests() -> None:
    with rig.published():
        w = World(disable=True)
        try:
            w.s.admit("a", list(range(1, 300)))
            snap = w.ledger.snapshot()
            assert not snap.violations
            for row in snap.accounts:
                if row.family != "other":
                    assert row.held == Held(request_only=row.occupied_slots), row.family
            assert any("radix cache disabled" in n for n in snap.engine.notes)
        finally:
            w.close()


class _Odd:
    """A cache class kvledger does not know."""


class _Broken:
    """A known class name whose sizes raise."""

    def full_protected_size(self) -> int:
        raise RuntimeError("boom")


_Broken.__name__ = "RadixCache"


@pytest.mark.parametrize(
    "tree, holder, note",
    [
        (None, "request_only", "no tree cache"),
        (_Odd(), "unattributed", "_Odd is not one kvledger reads"),
        (_Broken(), "unattributed", "RuntimeError: boom"),
    ],
)
def test_odd_caches_report_what_they_can_and_name_what_they_cannot(tree, holder, note) -> None:
    with rig.published():
        w = World()
        try:
            w.s.admit("a", list(range(1, 300)))
            w.reader.close()
            reader = HolderReader(
                w.ledger,
                w.accounts,
                tree=tree,
                allocator=w.alloc,
                req_to_token=w.r2t,
                units=w.units,
                running=lambda: w.s.running,
            )
            snap = w.ledger.snapshot()  # never raises
            assert not snap.violations
            for row in snap.accounts:
                if row.family == "other":
                    continue
                assert row.occupied_slots > 0
                assert getattr(row.held, holder) == row.occupied_slots, row.family
            assert any(note in n for n in snap.engine.notes), snap.engine.notes
            reader.close()
        finally:
            w.close()


@pytest.mark.parametrize("bridge", [False, True], ids=["native", "bridged"])
def test_the_plugins_rank_reads_the_schedulers_tree_and_publishes_the_holders(
    tmp_path, bridge
) -> None:
    """RankLedger.attach_scheduler (what the AFTER Scheduler.__init__ hook runs) on a
    scheduler's real tree cache, allocator and request pool: the published file carries the
    holders, the exporter's reader accepts it, close() leaves nothing held. Bridged, the SWA
    family's slots stay the bridge's (its allocator reports them)."""
    import time
    from pathlib import Path
    from types import SimpleNamespace

    from accounting.snapfile.head import load
    from kvledger.engines.sglang.bridge import ENV_ENABLE
    from kvledger.engines.sglang.plugin.rank import RankLedger

    with rig.published():
        pool = rig.make_pool()
        r2t = rig.make_req_to_token()
        alloc = rig.make_allocator(pool, r2t)
        tree = make_tree(alloc, r2t)
        s = TreeScheduler(alloc, r2t, tree)
        rank = RankLedger(
            {"model_name": "m"},
            directory=str(tmp_path),
            interval=60,
            bridge_env={ENV_ENABLE: "1" if bridge else "0"},
        )
        try:
            rank.add_runner(
                SimpleNamespace(token_to_kv_pool=pool, token_to_kv_pool_allocator=alloc)
            )
            scheduler = SimpleNamespace(
                tree_cache=tree,
                token_to_kv_pool_allocator=alloc,
                req_to_token_pool=r2t,
                running_batch=SimpleNamespace(reqs=s.running),
            )
            reader = rank.attach_scheduler(scheduler)
            assert reader is not None
            assert reader.bridged == ({"swa_kv"} if bridge else set())
            a = s.admit("a", list(range(1, 2 * PAGE + 10)))
            s.checkpoint(a)
            s.admit("b", list(range(1, 2 * PAGE + 1)) + [7] * 20)
            rank.publisher.publish()
            data = Path(rank.publisher.path).read_bytes()
            head = load(data, Path(rank.publisher.path).name, time.time())
            c4 = next(h for h in head.summary.holders if h.family == "c4_kv")
            assert c4.slots.tree_protected == 2 * PAGE // 4  # a's checkpointed prefix, locked
            swa = next(h for h in head.summary.holders if h.family == "swa_kv")
            assert swa.owner.value == ("vmm" if bridge else "runtime")
            assert swa.slots.total() == alloc.size_swa - alloc.swa_available_size()
            assert swa.slots.tree_protected == tree.swa_protected_size()
            assert c4.slots.request_only > 0 and c4.slots.unattributed == 0
            assert [r.rid for r in head.summary.engine.requests] == ["b", "a"]  # b holds more
            assert not head.summary.violations
            for r in list(s.running):
                s.finish(r)
        finally:
            rank.close()
        assert rank.holders is None and not rank.ledger.accounts()


def test_retractions_are_counted_and_a_bad_result_never_raises() -> None:
    from kvledger.engines.sglang.holders import PRESSURE
    from kvledger.engines.sglang.plugin import server_hooks

    before = PRESSURE.retracted_requests
    server_hooks.count_retraction((["r1", "r2"], 0.5, []), object())
    assert PRESSURE.retracted_requests == before + 2
    server_hooks.count_retraction(None)  # not SGLang's shape: ignored
    server_hooks.count_tree_eviction(object())
    assert PRESSURE.retracted_requests == before + 2


def test_a_hicache_host_tier_is_named_as_not_counted_and_the_device_holders_still_read() -> None:
    with rig.published():
        w = World()
        try:
            w.reader.close()
            w.tree.cache_controller = object()  # what init_hicache leaves on the tree
            reader = HolderReader(
                w.ledger,
                w.accounts,
                tree=w.tree,
                allocator=w.alloc,
                req_to_token=w.r2t,
                units=w.units,
                running=lambda: w.s.running,
            )
            a = w.s.admit("a", list(range(1, 2 * PAGE + 5)))
            w.s.checkpoint(a)
            snap = w.ledger.snapshot()
            c4 = next(r for r in snap.accounts if r.family == "c4_kv")
            assert c4.held.tree_protected == 2 * PAGE // 4 and c4.held.unattributed == 0
            assert any("HiCache host tier" in n for n in snap.engine.notes)
            reader.close()
            w.s.finish(a)
        finally:
            w.tree.cache_controller = None
            w.close()


def test_a_family_of_one_account_per_buffer_gets_the_familys_slots_on_each() -> None:
    """SGLang's own VMM owner registers each buffer as an account of its own
    (kvledger.engines.sglang.vmm_owner): each gets the family's occupancy and holders."""
    from tests.accounting.helpers import runtime_specs

    with rig.published():
        w = World()
        try:
            w.reader.close()
            extra = w.ledger.add_account(
                runtime_specs("dsv4b", "c4_kv", 1, rows=10_000, row_bytes=8)
            )
            accounts: dict[str, Any] = dict(w.accounts)
            accounts["c4_kv"] = [w.accounts["c4_kv"], extra]
            reader = HolderReader(
                w.ledger,
                accounts,
                tree=w.tree,
                allocator=w.alloc,
                req_to_token=w.r2t,
                units=w.units,
            )
            a = w.s.admit("a", list(range(1, 2 * PAGE + 5)))
            w.s.checkpoint(a)
            snap = w.ledger.snapshot()
            assert not snap.violations
            rows = [r for r in snap.accounts if r.family == "c4_kv"]
            assert len(rows) == 2 and rows[0].held == rows[1].held
            assert rows[0].held.tree_protected == 2 * PAGE // 4
            reader.close()
            w.s.finish(a)
            w.ledger.remove_account(extra)
        finally:
            w.close()
