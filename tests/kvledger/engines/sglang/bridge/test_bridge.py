"""The SGLang bridge against SGLang 0.5.23's real DeepSeek-V4 pool and SWA allocator, on CPU with
the host VMM backend (run through scripts/test-sglang)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from accounting.ledger import Ledger
from accounting.reconcile import host_memfd_truth
from allocator.errors import IncompatibleError
from allocator.host import HostBackend
from kvledger.engines.sglang.bridge import ENV_ENABLE, ENV_REQUIRE, attach, bridge_of, detach
from kvledger.engines.sglang.bridge.bridge import DEFAULT_POOL_OPTIONS
from kvledger.engines.sglang.bridge.compat import WRAPPED_METHODS, expected_row_bytes
from tests.kvledger.engines.sglang import rig
from tests.kvledger.engines.sglang.bridge.fakes import GRAN, LateReader, row_pages

pytestmark = pytest.mark.sglang

# GRAN (fakes): >= one 149,760-byte SWA row; 7 VMM pages per 9-row layer buffer
ROW = expected_row_bytes(rig.PAGE)
ON = {ENV_ENABLE: "1"}
# Pages go back as soon as they empty, on the freeing thread (no background mapper).
EXACT = {"max_spare_pages": 0, "handle_pool_pages": 0, "unmap_grace_s": 0.0, "map_ahead": False}
# SGLang keeps these; "other" is the full->SWA index mapping the allocator registers on the pool.
RUNTIME_FAMILIES = {
    "other",
    "c4_kv",
    "c128_kv",
    "c4_indexer",
    "c4_attn_state",
    "c4_indexer_state",
    "c128_state",
}
GB = 1 << 30
# A DeepSeek-V4.1-shaped pool: ratio-1/2 layers whose first of each run is the kv_source.
V41_RATIOS = [0, 1, 1, 2, 2, 4, 128]
V41_SOURCES = [1, 3]


@pytest.fixture(scope="module", autouse=True)
def _published() -> Iterator[None]:
    with rig.published():
        yield


class Rig:
    def __init__(self, *, need_sort: bool = False, **pool_kw: Any) -> None:
        self.pool = rig.make_pool(**pool_kw)
        self.r2t = rig.make_req_to_token()
        self.alloc = rig.make_allocator(self.pool, self.r2t, need_sort=need_sort)
        self.sched = rig.Scheduler(self.alloc, self.r2t)
        self.ledger = Ledger({"model_name": "dsv4-test"})
        self.backend = HostBackend(granularity=GRAN)
        self.bridge: Any = None
        self._truth = False

    def attach(self, **kw: Any) -> Any:
        kw.setdefault("env", ON)
        kw.setdefault("backend", self.backend)
        self.bridge = attach(self.pool, self.ledger, allocator=self.alloc, **kw)
        if self.bridge.active and not self._truth:
            self.ledger.add_truth(
                host_memfd_truth(self.backend.physical_bytes, self.bridge.quiescent)
            )
            self._truth = True
        return self.bridge

    def close(self) -> None:
        detach(self.pool)
        self.backend.close()


@pytest.fixture
def r() -> Iterator[Rig]:
    rg = Rig()
    yield rg
    rg.close()


def held(rg: Rig) -> int:
    """Rows the follower holds once the policy's journal is replayed."""
    rg.bridge.flush()
    return int(rg.bridge.follower.held_rows)


def check(rg: Rig) -> Any:
    """Pages, ledger figures and host reconciliation agree with SGLang's allocator (after
    the policy's journal is replayed)."""
    br, alloc = rg.bridge, rg.alloc
    br.flush()
    if br.mapper is not None:
        assert br.mapper.wait_idle()
    engine = br.policy.held_by_engine()
    assert br.follower.held().tolist() == engine
    assert br.follower.divergences == 0
    need = set().union(*(row_pages(p, row_bytes=br.facts.row_bytes) for p in [0, *engine]))
    sp = br.store
    mapped = {p for p in range(sp.num_pages) if sp.is_mapped(p)}
    assert need <= mapped
    # Idle, spares beyond the watermark are only pages wanted ahead, grace_pages at most.
    extra = mapped - need
    watermark = sp.policy.max_spare_pages
    assert len(extra) <= watermark + sp.policy.grace_pages
    if len(extra) > watermark:
        assert len(extra - set(sp.policy.ahead) - set(sp.policy.pinned)) <= watermark
    snap = rg.ledger.snapshot()
    assert snap.violations == ()
    swa = snap.rollup("family", "owner")[("swa_kv", "vmm")]
    layers = len(rg.pool.swa_kv_pool.kv_buffer)
    assert swa["occupied_slots"] == rig.PAGE * len(engine)
    assert swa["occupied_slots"] == alloc.size_swa - alloc.swa_available_size()
    assert swa["tensor_bytes"] == layers * br.facts.rows * expected_row_bytes(
        rig.PAGE, br.facts.kv_layout
    )
    assert swa["mapped_bytes"] == len(mapped) * GRAN * layers
    assert swa["physical_bytes"] == sp.stats()["physical_bytes"]
    (rec,) = snap.reconciliation
    assert rec["source"] == "host_memfd" and rec["available"]
    assert rec["device_bytes"] == rg.backend.physical_bytes() == swa["physical_bytes"]
    assert rec["unattributed_bytes"] == 0
    return snap


def usage_gb(snap: Any) -> float:
    """sglang:kv_cache_memory_usage_gb: physical bytes of all families / 2^30 (docs/background.md#the-four-figures)."""
    return snap.total("physical_bytes") / GB


def scrape(ledger: Ledger) -> dict[tuple[str, str | None], float]:
    """What kvledger's exporter serves for `ledger`: (metric, family) -> value."""
    from exporter.collector import registry_for
    from exporter.metrics import HEADLINE, figure_metric
    from exporter.sources import Sources

    sources = Sources()
    sources.add_ledger(ledger)
    wanted = {HEADLINE, figure_metric("physical_bytes"), figure_metric("tensor_bytes")}
    out: dict[tuple[str, str | None], float] = {}
    for metric in registry_for(sources).collect():
        for sample in metric.samples:
            if sample.name in wanted:
                out[(sample.name, sample.labels.get("family"))] = sample.value
    return out


def check_scrape(rg: Rig) -> float:
    """The exporter's headline and swa_kv gauges; returns the headline."""
    got = scrape(rg.ledger)
    swa = rg.bridge.store
    layers = len(rg.pool.swa_kv_pool.kv_buffer)
    rows = rg.bridge.facts.rows
    row = expected_row_bytes(rig.PAGE, rg.bridge.facts.kv_layout)
    assert got[("sglang:kv_cache_tensor_bytes", "swa_kv")] == layers * rows * row
    assert got[("sglang:kv_cache_physical_bytes", "swa_kv")] == swa.stats()["physical_bytes"]
    headline = got[("sglang:kv_cache_memory_usage_gb", None)]
    assert headline == pytest.approx(usage_gb(rg.ledger.snapshot(reconcile=False)))
    return headline


# -- attach --------------------------------------------------------------------------------------
def test_attach_replaces_each_swa_buffer_in_place(r: Rig) -> None:
    import torch

    sub = r.pool.swa_kv_pool
    buffers = sub.kv_buffer
    before = [(tuple(t.shape), t.dtype, t.is_contiguous()) for t in buffers]
    others = {id(t) for t in r.pool.c4_kv_pool.kv_buffer} | {
        id(t) for t in r.pool.c128_kv_pool.kv_buffer
    }
    br = r.attach(pool_options=EXACT)
    assert br.active and br.reason == ""
    assert sub.kv_buffer is buffers  # the list SGLang's readers hold is kept
    after = [(tuple(t.shape), t.dtype, t.is_contiguous()) for t in buffers]
    assert after == before == [((rig.SWA_PAGES + 1, ROW), torch.uint8, True)] * len(rig.RATIOS)
    for layer, t in enumerate(buffers):
        assert t.data_ptr() == br.tensors[layer].data_ptr()
        assert r.pool.get_swa_raw_buffer(layer).data_ptr() == t.data_ptr()
        assert r.pool.get_swa_key_buffer_radix(layer).data_ptr() == t.data_ptr()
    assert others == {id(t) for t in r.pool.c4_kv_pool.kv_buffer} | {
        id(t) for t in r.pool.c128_kv_pool.kv_buffer
    }
    owners = {(a.family, a.owner.value) for a in r.ledger.accounts()}
    assert owners == {("swa_kv", "vmm")} | {(f, "runtime") for f in RUNTIME_FAMILIES}
    assert set(vars(r.alloc.swa_attn_allocator)) >= set(WRAPPED_METHODS)
    # The full-token index space is logical: no buffer behind it, its allocator unwrapped.
    assert getattr(r.pool, "full_kv_pool", None) is None
    assert r.alloc.full_attn_allocator.get_kvcache() is None
    assert not set(vars(r.alloc.full_attn_allocator)) & set(WRAPPED_METHODS)
    snap = check(r)
    # Only SGLang's padding page (row 0) is backed: one VMM page per layer.
    swa = snap.rollup("family")[("swa_kv",)]
    assert swa["physical_bytes"] == GRAN * len(rig.RATIOS)
    assert swa["tensor_bytes"] == len(rig.RATIOS) * (rig.SWA_PAGES + 1) * ROW


def test_facts_read_from_the_real_pool(r: Rig) -> None:
    br = r.attach()
    f = br.facts
    assert (f.kv_layout, f.swa_storage, f.token_bytes, f.page_tokens) == ("v4", "paged", 584, 256)
    assert (f.rows, f.row_bytes, f.allocator_pages) == (rig.SWA_PAGES + 1, 149760, rig.SWA_PAGES)
    assert f.allocator_class == "PagedTokenToKVPoolAllocator" and f.allocator_missing == ()


def test_prefill_decode_window_eviction_and_finish_move_pages(r: Rig) -> None:
    r.attach(pool_options=EXACT)
    s = r.sched
    base = check(r)
    g0 = usage_gb(base)
    assert check_scrape(r) == pytest.approx(g0)

    a = s.prefill(300)  # 2 pages
    b = s.prefill(600)  # 3 pages
    snap = check(r)
    assert held(r) == 5
    assert usage_gb(snap) > g0
    assert check_scrape(r) == pytest.approx(usage_gb(snap))

    for _ in range(230):  # a: 300 -> 530 and b: 600 -> 830 each cross into one more page
        s.decode([a, b])
    snap = check(r)
    assert held(r) == 7
    peak = usage_gb(snap)

    s.evict_window(a)  # tokens [0, 256) of a left the 128-token window
    assert s.evicted(a) == 256
    snap = check(r)
    assert held(r) == 6
    assert usage_gb(snap) <= peak
    assert check_scrape(r) == pytest.approx(usage_gb(snap))

    s.evict_window(b)  # b at 830: [0, 512) leaves the window
    assert s.evicted(b) == 512
    check(r)
    assert held(r) == 4

    s.finish(b)
    check(r)
    s.finish(a)
    snap = check(r)
    assert held(r) == 0
    assert snap.rollup("family")[("swa_kv",)]["occupied_slots"] == 0
    assert usage_gb(snap) == g0  # back to the padding page and the runtime families
    assert check_scrape(r) == pytest.approx(g0)
    assert r.alloc.swa_available_size() == r.alloc.size_swa


def test_spare_pages_stay_mapped_with_default_pool_options(r: Rig) -> None:
    r.attach()
    a = r.sched.prefill(3 * rig.PAGE)
    held = check(r).rollup("family")[("swa_kv",)]["physical_bytes"]
    r.sched.finish(a)
    snap = check(r)
    swa = snap.rollup("family")[("swa_kv",)]
    assert swa["occupied_slots"] == 0
    # Spare page ids stay mapped (mapped ahead for the next allocations, up to the default
    # max_spare_pages) and their handle sets are counted, not lost.
    # Beyond them, grace_pages more while the front policy still wants them ahead.
    spares = DEFAULT_POOL_OPTIONS["max_spare_pages"]
    ids = swa["mapped_bytes"] // (GRAN * len(rig.RATIOS))
    assert swa["mapped_bytes"] == ids * GRAN * len(rig.RATIOS)
    assert 1 + spares <= ids <= 1 + spares + DEFAULT_POOL_OPTIONS["grace_pages"]
    store = r.bridge.store
    with store.lock:
        stale = [p for p in store.spares if store.policy.stale(p)]
    assert len(stale) <= spares
    assert GRAN * len(rig.RATIOS) < swa["physical_bytes"] <= held


def test_free_group_returns_pages_at_group_end(r: Rig) -> None:
    r.attach(pool_options=EXACT)
    a = r.sched.prefill(2 * rig.PAGE)
    b = r.sched.prefill(rig.PAGE)
    r.alloc.free_group_begin()
    r.sched.finish(a)
    r.sched.finish(b)
    assert held(r) == 3  # SGLang defers; so does the mapping
    check(r)
    r.alloc.free_group_end()
    assert held(r) == 0
    check(r)


def test_staged_frees_and_their_merge_are_followed() -> None:
    """With need_sort (PD disaggregation), freed pages wait in SGLang's staged list and are
    merged and sorted back into the free list when an allocation runs short."""
    rg = Rig(need_sort=True)
    try:
        rg.attach(pool_options=EXACT)
        s = rg.sched
        reqs = [s.prefill(2 * rig.PAGE) for _ in range(3)]  # 6 of 8 pages
        s.finish(reqs[0])
        s.finish(reqs[2])
        assert rg.alloc.swa_attn_allocator.num_staged_pages == 4
        check(rg)
        big = s.prefill(5 * rig.PAGE)  # 2 free pages left: forces the merge
        assert rg.alloc.swa_attn_allocator.num_staged_pages == 0
        assert held(rg) == 7
        check(rg)
        s.finish(big)
        s.finish(reqs[1])
        check(rg)
        assert held(rg) == 0
    finally:
        rg.close()


def test_clear_gives_every_page_back(r: Rig) -> None:
    r.attach(pool_options=EXACT)
    r.sched.prefill(4 * rig.PAGE)
    r.alloc.clear()
    assert held(r) == 0
    check(r)


def test_attach_with_live_pages_copies_them_and_follows(r: Rig) -> None:
    a = r.sched.prefill(300)
    pages = sorted(
        {
            int(i) // rig.PAGE
            for i in r.alloc.translate_loc_from_full_to_swa(
                r.r2t.req_to_token[a.kv.req_pool_idx, :300].long()
            )
        }
    )
    sub = r.pool.swa_kv_pool
    for layer, t in enumerate(sub.kv_buffer):
        for p in [0, *pages]:
            t[p].fill_(layer * 16 + p + 1)
    r.attach(pool_options=EXACT)
    assert r.bridge.follower.held().tolist() == pages
    for layer, t in enumerate(sub.kv_buffer):
        for p in [0, *pages]:
            assert bool((t[p] == layer * 16 + p + 1).all())
    check(r)
    r.sched.finish(a)
    assert held(r) == 0
    check(r)


def _nothing_changed(rg: Rig, buffers: list[Any]) -> None:
    assert all(a is b for a, b in zip(buffers, rg.pool.swa_kv_pool.kv_buffer, strict=True))
    assert not set(vars(rg.alloc.swa_attn_allocator)) & set(WRAPPED_METHODS)
    assert rg.backend.stats() == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
    }
    assert rg.backend.physical_bytes() == 0
    assert bridge_of(rg.pool) is None


def test_a_failure_half_way_undoes_every_step(r: Rig) -> None:
    from allocator.errors import CapacityError

    r.sched.prefill(2 * rig.PAGE)  # live pages to map at attach
    buffers = list(r.pool.swa_kv_pool.kv_buffer)
    one_page_id = GRAN * len(rig.RATIOS)  # room for the padding page only
    with pytest.raises(CapacityError, match="physical_budget"):
        r.attach(pool_options={"physical_budget": one_page_id})
    _nothing_changed(r, buffers)
    assert r.ledger.accounts() == ()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_ahead_pages_is_refused_naming_it_and_undoes_every_step(r: Rig, bad: object) -> None:
    buffers = list(r.pool.swa_kv_pool.kv_buffer)
    with pytest.raises(ValueError, match=f"ahead_pages={bad!r}, expected an int >= 0"):
        r.attach(pool_options={"ahead_pages": bad})
    _nothing_changed(r, buffers)
    assert r.ledger.accounts() == ()


def test_a_pool_already_in_the_ledger_is_refused_untouched(r: Rig) -> None:
    from kvledger.engines.sglang.inventory import register_pool

    register_pool(r.ledger, r.pool, name="dsv4")
    accounts = r.ledger.accounts()
    buffers = list(r.pool.swa_kv_pool.kv_buffer)
    with pytest.raises(ValueError, match="already registered"):
        r.attach()
    _nothing_changed(r, buffers)
    assert r.ledger.accounts() == accounts


def test_attach_twice_is_a_no_op(r: Rig) -> None:
    first = r.attach()
    epoch, stats = r.ledger.epoch, first.stats()
    buffers = list(r.pool.swa_kv_pool.kv_buffer)
    assert r.attach() is first
    assert attach(r.pool, r.ledger, allocator=r.alloc, env=ON) is first
    assert r.ledger.epoch == epoch and first.stats() == stats
    assert all(a is b for a, b in zip(buffers, r.pool.swa_kv_pool.kv_buffer, strict=True))
    assert bridge_of(r.pool) is first


# -- detach ---------------------------------------------------------------------------------------
def test_detach_restores_native_buffers_and_leaves_nothing_mapped(r: Rig) -> None:
    import torch

    br = r.attach(pool_options=EXACT)
    a = r.sched.prefill(2 * rig.PAGE)
    live = br.follower.held().tolist()
    sub = r.pool.swa_kv_pool
    for layer, t in enumerate(sub.kv_buffer):
        t[live[-1]].fill_(layer + 7)
    br.detach()
    assert not br.active and bridge_of(r.pool) is None
    # Nothing held by the backend: no reservations, handles or mappings; memfd blocks 0.
    assert r.backend.stats() == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
    }
    assert r.backend.physical_bytes() == 0
    assert r.ledger.accounts() == ()
    assert not set(vars(r.alloc.swa_attn_allocator)) & set(WRAPPED_METHODS)
    for layer, t in enumerate(sub.kv_buffer):
        assert t.shape == (rig.SWA_PAGES + 1, ROW) and t.dtype == torch.uint8
        assert t.untyped_storage().nbytes() == t.numel()  # an ordinary tensor again
        assert bool((t[live[-1]] == layer + 7).all())
    # SGLang carries on natively, and the pool can be attached again.
    r.sched.finish(a)
    b = r.sched.prefill(rig.PAGE)
    again = r.attach(pool_options=EXACT)
    assert again is not br and again.active
    assert again.follower.held().tolist() == r.bridge.policy.held_by_engine() != []
    check(r)
    r.sched.finish(b)
    check(r)
    detach(r.pool)
    detach(r.pool)  # idempotent
    br.detach()
    assert r.backend.physical_bytes() == 0 and r.ledger.accounts() == ()


def test_detach_unmaps_only_after_its_copy_back_has_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the copy of the live rows back into native buffers is queued on the stream when
    detach unmaps the pages; the store's close must wait for it (issue 23: without, an
    illegal address on a busy H200). Modelled with tests.allocator.queued.QueuedDevice: the
    copies' source rows are queued device work until a synchronize."""
    from kvledger.engines.sglang.bridge import bridge as bridge_mod
    from tests.allocator.queued import QueuedDevice

    rg = Rig()
    dev = QueuedDevice(rg.backend)
    rg.backend = dev  # type: ignore[assignment]
    try:
        br = rg.attach(pool_options=EXACT)
        rg.sched.prefill(2 * rig.PAGE)
        br.flush()
        real = bridge_mod.native_copy

        def queued_copy(vmm: list[Any], follower: Any, facts: Any) -> list[Any]:
            out = real(vmm, follower, facts)
            for t in vmm:
                for row in [0, *follower.held().tolist()]:
                    dev.queue(t[row].data_ptr(), ROW)  # read by a copy not run yet
            return out

        monkeypatch.setattr(bridge_mod, "native_copy", queued_copy)
        br.detach()
        assert dev.queued == [] and dev.syncs == 1
        assert dev.faults == []
        assert rg.backend.physical_bytes() == 0
    finally:
        rg.close()


# -- DeepSeek-V4.1 ---------------------------------------------------------------------------------
def _v41_rig(layout: str = "v41") -> Rig:
    return Rig(ratios=V41_RATIOS, kv_layout=layout, kv_source_layers=V41_SOURCES)


def test_v41_pool_is_bridged_and_follows_sglangs_pages() -> None:
    """SGLang 0.5.23's V4.1 pool (v41 SWA layout, 528-byte tokens; ratio-1/2 kv_source layers):
    the SWA rows go on the VMM pool, every other family stays SGLang's, figures agree."""
    rg = _v41_rig()
    try:
        br = rg.attach(pool_options=EXACT)
        assert br.active, br.reason
        f = br.facts
        assert (f.kv_layout, f.swa_storage, f.token_bytes, f.page_tokens) == (
            "v41",
            "paged",
            528,
            256,
        )
        assert (f.rows, f.row_bytes) == (rig.SWA_PAGES + 1, 256 * 528)
        owners = {(a.family, a.owner.value) for a in rg.ledger.accounts()}
        low = {"c1_kv", "c2_kv", "c1_indexer", "c2_indexer", "c2_state"}
        assert owners == {("swa_kv", "vmm")} | {(x, "runtime") for x in RUNTIME_FAMILIES | low}
        swa = next(a for a in rg.ledger.accounts() if a.family == "swa_kv")
        assert {b.slot_bytes for b in swa.buffers} == {528}
        s = rg.sched
        a = s.prefill(300)
        b = s.prefill(600)
        check(rg)
        assert held(rg) == 5
        for _ in range(230):
            s.decode([a, b])
        check(rg)
        assert held(rg) == 7
        s.evict_window(a)
        check(rg)
        s.finish(a)
        s.finish(b)
        snap = check(rg)
        assert held(rg) == 0
        assert snap.rollup("family")[("swa_kv",)]["occupied_slots"] == 0
    finally:
        rg.close()


@pytest.mark.parametrize("layout", ["v41", "v41_new"])
def test_v41_bytes_round_trip_through_attach_and_detach(layout: str) -> None:
    """Rows SGLang holds before attach are copied onto the VMM pool byte for byte, rows
    written while bridged are there too, and detach carries every held row (and the padding
    row) back into native tensors of SGLang's shape; nothing stays mapped."""
    import torch

    rg = _v41_rig(layout)
    try:
        gen = torch.Generator().manual_seed(41)
        sub = rg.pool.swa_kv_pool
        a = rg.sched.prefill(300)  # 2 pages, native
        pages = sorted(
            {
                int(i) // rig.PAGE
                for i in rg.alloc.translate_loc_from_full_to_swa(
                    rg.r2t.req_to_token[a.kv.req_pool_idx, :300].long()
                )
            }
        )
        want: dict[tuple[int, int], Any] = {}

        def write(rows: list[int]) -> None:
            for layer, t in enumerate(sub.kv_buffer):
                for row in rows:
                    v = torch.randint(0, 256, (t.shape[1],), dtype=torch.uint8, generator=gen)
                    t[row].copy_(v)
                    want[(layer, row)] = v

        write([0, *pages])
        br = rg.attach(pool_options=EXACT)
        assert br.active, br.reason
        assert br.follower.held().tolist() == pages
        for (layer, row), v in want.items():
            assert torch.equal(sub.kv_buffer[layer][row], v)  # read through the VMM mapping
        b = rg.sched.prefill(rig.PAGE)  # one more page, while bridged
        new = sorted(set(br.follower.held().tolist()) - set(pages))
        assert len(new) == 1
        write(new)
        check(rg)
        held_rows = br.follower.held().tolist()
        br.detach()
        assert rg.backend.physical_bytes() == 0 and rg.ledger.accounts() == ()
        for layer, t in enumerate(sub.kv_buffer):
            assert t.shape == (rig.SWA_PAGES + 1, 256 * 528) and t.dtype == torch.uint8
            assert t.untyped_storage().nbytes() == t.numel()  # native again
            for row in range(t.shape[0]):
                if row == 0 or row in held_rows:
                    assert torch.equal(t[row], want[(layer, row)]), (layer, row)
                else:
                    assert not bool(t[row].any()), (layer, row)
        rg.sched.finish(a)
        rg.sched.finish(b)
    finally:
        rg.close()


def test_detach_closes_a_backend_the_bridge_made(r: Rig) -> None:
    made: list[HostBackend] = []

    def factory() -> HostBackend:
        made.append(HostBackend(granularity=GRAN))
        return made[-1]

    br = r.attach(backend=factory)
    assert br.owns_backend and br.backend is made[0]
    r.sched.prefill(rig.PAGE)
    br.detach()
    assert made[0].closed


def test_a_detach_whose_close_raises_says_its_cause_and_keeps_what_it_could_not_free(
    r: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's close raising (seen on an H100: a wait the sync debug mode refused) must
    not be hidden behind the ledger's refusal to drop an account still attached, and must not
    lose that account: the next detach closes what is left and removes it."""
    br = r.attach(pool_options=EXACT)
    a = r.sched.prefill(2 * rig.PAGE)
    store = br.store
    real_close = store.close

    def refused() -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(store, "close", refused)
    with pytest.raises(RuntimeError) as raised:
        br.detach()
    assert str(raised.value) == "refused"  # the cause itself, not the ledger's refusal
    assert not br.active and br.swa_account is not None
    assert [acc.family for acc in r.ledger.accounts()] == ["swa_kv"]  # the rest removed
    assert r.backend.physical_bytes() > 0  # not unmapped: the store never closed
    monkeypatch.setattr(store, "close", real_close)
    br.detach()  # closes what is left, removes the account it kept
    assert br.swa_account is None and r.ledger.accounts() == ()
    assert r.backend.physical_bytes() == 0 and r.backend.stats()["mappings"] == 0
    br.detach()  # idempotent
    r.sched.finish(a)


# -- off and incompatible ---------------------------------------------------------------------------
def test_off_without_the_environment_variable(r: Rig) -> None:
    buffers = list(r.pool.swa_kv_pool.kv_buffer)
    br = r.attach(env={})
    assert not br.active and ENV_ENABLE in br.reason
    assert all(a is b for a, b in zip(buffers, r.pool.swa_kv_pool.kv_buffer, strict=True))
    assert not set(vars(r.alloc.swa_attn_allocator)) & set(WRAPPED_METHODS)
    owners = {(a.family, a.owner.value) for a in r.ledger.accounts()}
    assert owners == {(f, "runtime") for f in RUNTIME_FAMILIES | {"swa_kv"}}
    assert r.backend.stats()["reservations"] == 0
    br.detach()
    assert r.ledger.accounts() == ()


def _unified_pool() -> Any:
    import sglang.srt.layers.attention.dsv4.unified_kv_gate as gate

    real = gate.is_unified_kv_triton
    gate.is_unified_kv_triton = lambda: True  # the gate is HIP-only; force it on CPU
    try:
        return rig.make_pool()
    finally:
        gate.is_unified_kv_triton = real


def _request_window_pool() -> Any:
    """Encoder replay: SGLang keeps the target's SWA rows in a request window, no paged pool."""
    return rig.make_pool_with(
        {"enable_encoder_swa_bounded_replay": True, "chunked_prefill_size": 1024},
        ratios=V41_RATIOS,
        kv_layout="v41",
        kv_source_layers=V41_SOURCES,
    )


def _incompatible(kind: str) -> tuple[Rig, dict[str, Any], str]:
    if kind == "unified":
        rg = Rig()
        rg.pool = _unified_pool()
        return rg, {"allocator_none": True}, "'unified'"
    if kind == "request_window":
        rg = Rig()
        rg.pool = _request_window_pool()
        return rg, {"allocator_none": True}, "SWA storage is 'request_window' (encoder replay"
    if kind == "granularity":
        rg = Rig()
        rg.backend.close()
        rg.backend = HostBackend(granularity=16 * 4096)
        return rg, {}, "exceeds the VMM page"
    if kind == "token_allocator":
        rg = Rig()
        rg.alloc = rig.make_allocator(rg.pool, rg.r2t, page_size=1)
        return rg, {}, "lacks"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["unified", "request_window", "granularity", "token_allocator"])
def test_incompatible_pool_stays_native_with_a_warning(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    rg, opts, why = _incompatible(kind)
    try:
        if opts.get("allocator_none"):
            rg.alloc = None
        sub = rg.pool.swa_kv_pool
        buffers = list(sub.kv_buffer) if sub is not None else []
        with caplog.at_level(logging.WARNING, logger="kvledger.engines.sglang.bridge.bridge"):
            br = rg.attach()
        assert not br.active and why in br.reason
        assert why in caplog.text and "stay native" in caplog.text
        if sub is not None:
            assert all(a is b for a, b in zip(buffers, sub.kv_buffer, strict=True))
        assert all(a.owner.value == "runtime" for a in rg.ledger.accounts())
        assert rg.backend.stats()["reservations"] == 0
    finally:
        rg.close()


@pytest.mark.parametrize("kind", ["unified", "request_window", "granularity", "token_allocator"])
def test_incompatible_pool_fails_when_required(kind: str) -> None:
    rg, opts, why = _incompatible(kind)
    try:
        if opts.get("allocator_none"):
            rg.alloc = None
        with pytest.raises(IncompatibleError, match="required") as e:
            rg.attach(require=True)
        assert why in str(e.value)
        assert rg.ledger.accounts() == () and bridge_of(rg.pool) is None
        assert rg.backend.stats()["reservations"] == 0
    finally:
        rg.close()


def test_require_is_read_from_the_environment() -> None:
    rg, _, _ = _incompatible("granularity")
    try:
        with pytest.raises(IncompatibleError, match=ENV_REQUIRE):
            rg.attach(env={ENV_ENABLE: "1", ENV_REQUIRE: "1"})
    finally:
        rg.close()


def test_a_pool_of_another_kind_is_refused(r: Rig) -> None:
    with pytest.raises(IncompatibleError, match="expected SGLang's DeepSeekV4TokenToKVPool"):
        attach(r.pool.swa_kv_pool, r.ledger, allocator=r.alloc, env=ON, require=True)


def test_an_allocator_serving_another_pool_is_refused(r: Rig) -> None:
    """SGLang's `get_kvcache()` names the pool an allocator serves: another pool's is refused
    (its page ids would not be this pool's rows), and nothing of it is wrapped."""
    other = Rig()
    try:
        assert other.alloc.get_kvcache() is other.pool
        with pytest.raises(IncompatibleError, match="serves another pool"):
            attach(r.pool, r.ledger, allocator=other.alloc, env=ON, require=True)
        assert not set(vars(other.alloc.swa_attn_allocator)) & set(WRAPPED_METHODS)
        assert r.ledger.accounts() == ()
    finally:
        other.close()


# -- data written by SGLang's own store path -------------------------------------------------------
def test_sglang_store_kernel_writes_land_in_the_vmm_buffer() -> None:
    """SGLang's SWA store (`set_swa_key_buffer`: its Triton SetKAndS kernel, run by Triton's
    interpreter on CPU) writes through the bridged buffer into VMM memory, byte for byte as
    into a native pool, and detach carries the rows back. A subprocess, because
    TRITON_INTERPRET is read when SGLang's kernels are defined."""
    root = Path(__file__).resolve().parents[5]
    # Extend PYTHONPATH, never replace it: SGLang may be importable only through it
    # (the device's carried wheels in /tmp/site).
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kvledger.engines.sglang.bridge.writes"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["nonzero_bytes"] > 0
    assert out["in_vmm_reservation"] is True
    assert out["rows_equal_native"] is True
    assert out["detached_rows_equal_native"] is True
    assert out["backend_after_detach"] == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
        "physical_bytes": 0,
    }


def test_device_style_readback_gives_pages_back_once_read_and_waits_only_when_needed(
    r: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA read-back path on CPU: the ids of a batch arrive later (a pinned copy and an
    event). Until then the follower has not heard of the rows, and their pages stay mapped
    and pinned; a replay after the copy landed reads them without waiting; one that needs
    them sooner waits, and is counted."""
    from kvledger.engines.sglang.bridge import bridge as bridge_mod

    late = LateReader()
    monkeypatch.setattr(bridge_mod, "reader_for", lambda device: late)
    br = r.attach(pool_options=EXACT)
    reader = br.policy.reader
    a = r.sched.prefill(2 * rig.PAGE)
    rows = br.policy.held_by_engine()
    r.sched.finish(a)
    br.policy.flush(wait=False)  # the read starts; the ids are not there yet
    assert br.follower.held_rows == 0  # the follower has not heard of `a` ...
    assert all(br.store.is_mapped(p) for p in br.follower.pages_of(rows))  # ... its pages stay
    assert set(br.follower.pages_of(rows)) <= set(br.store.policy.pinned)
    late.land_all()
    br.policy.flush(wait=False)  # the copies landed: replayed without waiting
    assert reader.waits == 0 and br.follower.held_rows == 0  # taken and released: netted
    b = r.sched.prefill(rig.PAGE)
    br.policy.flush(wait=True)  # b's read has not landed: the replay waits, and counts it
    assert reader.waits == 1 and br.follower.held_rows == 1
    assert br.stats()["readback_waits"] == 1
    check(r)
    r.sched.finish(b)
    br.policy.flush(wait=False)  # the read of b's release starts ...
    late.land_all()  # ... and lands before the next replay: no wait
    check(r)
    assert reader.waits == 1 and br.follower.held_rows == 0


@pytest.mark.parametrize("options", ["default", "exact", "lagging"])
def test_every_row_sglang_holds_is_mapped_after_every_call(
    r: Rig, options: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's safety rule: the follower hears of allocations late, yet after every
    call SGLang makes, every row it holds (and the padding row) lies on mapped pages, with
    the background mapper unmapping spares meanwhile (default options), none kept (exact),
    or the ids of a batch arriving several replays late (lagging: the CUDA path)."""
    import random

    from kvledger.engines.sglang.bridge import bridge as bridge_mod

    rng = random.Random(11)
    if options == "lagging":
        monkeypatch.setattr(bridge_mod, "reader_for", lambda device: LateReader(rng))
    br = r.attach(pool_options=EXACT if options == "exact" else None)
    s = r.sched
    live: list[Any] = []
    for moves in range(1, 401):
        op = rng.random()
        free_pages = r.alloc.swa_available_size() // rig.PAGE
        if live and (op < 0.3 or len(live) == 4 or free_pages < 3):
            s.finish(live.pop(rng.randrange(len(live))))
        elif op < 0.6:
            live.append(s.prefill(rng.randint(1, 2 * rig.PAGE)))
        else:
            req = live[rng.randrange(len(live))] if live else None
            if req is not None and req.seq_len < 3 * rig.PAGE and free_pages >= 1:
                s.decode([req])
            elif req is not None:
                s.evict_window(req)
        held = br.policy.held_by_engine()  # SGLang's truth, read without a replay
        unmapped = [p for p in br.follower.pages_of([0, *held]) if not br.store.is_mapped(p)]
        assert unmapped == [], f"after move {moves}: rows {held} use unmapped pages {unmapped}"
        if options != "exact":
            with br.store.lock:  # the harshest policy: every spare not pinned goes
                br.store.policy.trim_locked(keep=0)
    for req in live:
        s.finish(req)
    check(r)
    assert br.stats()["held_pages"] == 0


def test_a_reader_thread_closes_a_batch_only_between_sglang_calls(
    r: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stats()` from another thread replays what was recorded, but closes a batch (reads
    SGLang's front) only when no hooked call is running on the allocator's thread: here one
    runs inside SGLang's own `_release_page_ids`, called through the hooks."""
    import threading

    sub = r.alloc.swa_attn_allocator
    release = type(sub)._release_page_ids
    inside: list[int] = []  # what was recorded and not drained, seen from inside the call
    stall = [False]

    def read() -> None:
        t = threading.Thread(target=r.bridge.stats)
        t.start()
        t.join()

    def release_with_a_reader(self: Any, *page_ids: Any) -> Any:
        if self is sub and stall[0]:
            read()
            inside.append(len(r.bridge.policy.journal.raw))
        return release(self, *page_ids)

    monkeypatch.setattr(type(sub), "_release_page_ids", release_with_a_reader)
    br = r.attach()  # the hooks wrap the method as patched above
    br.mapper.on_idle = None  # no idle replay from the mapper: this is about reader threads
    a, b = r.sched.prefill(rig.PAGE), r.sched.prefill(rig.PAGE)
    r.sched.finish(a)
    recorded = len(br.policy.journal.raw)
    assert recorded > 0
    stall[0] = True
    r.sched.finish(b)
    stall[0] = False
    assert inside and inside[0] == recorded  # nothing closed mid-call
    read()  # between calls: everything recorded is closed and replayed
    assert len(br.policy.journal.raw) == 0 and br.follower.held_rows == 0
    check(r)


def test_the_mapper_replays_a_journal_sglang_left_alone(r: Rig) -> None:
    """Pages freed by an engine that then goes quiet come back without anyone asking: the
    background mapper replays the journal once no hooked call came for IDLE_FLUSH_S."""
    import time

    br = r.attach()
    a = r.sched.prefill(2 * rig.PAGE)
    r.sched.finish(a)
    assert len(br.policy.journal) > 0  # recorded, not replayed
    deadline = time.monotonic() + 5.0
    while (len(br.policy.journal) or br.follower.held_rows) and time.monotonic() < deadline:
        time.sleep(0.01)  # the mapper's replay: the journal empties, then the follower moves
    assert len(br.policy.journal) == 0 and br.follower.held_rows == 0
    check(r)
