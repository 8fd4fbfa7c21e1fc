"""SwaPool: slots handed out and returned, pages mapped and unmapped to match, all or nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from allocator.errors import CapacityError, ClosedError, SlotError
from allocator.host import HostBackend
from allocator.slots.layout import SlotLayout
from allocator.slots.pool import SwaPool
from tests.allocator.rigs import (
    DSV4_ROW_BYTES,
    DSV4_SLOT_BYTES,
    DSV4_SLOTS_PER_ROW,
    KIB,
    SMALL_GRANULARITY,
    FailingBackend,
    Rig,
)

PAGE = SMALL_GRANULARITY
SLOTS_PER_PAGE = 4  # the default rig: 64 slots of 16 KiB on 64 KiB pages, 16 pages, 3 layers

MakeRig = Callable[..., Rig]


def _pages_of(pool: SwaPool, ids: Any) -> set[int]:
    out: set[int] = set()
    for i in torch.as_tensor(ids).tolist():
        out.update(pool.layout.slot_pages(i))
    return out


def _mapped_pages(pool: SwaPool) -> list[int]:
    return [p for p in range(pool.layout.num_pages) if pool.is_page_mapped(p)]


def _assert_backend_mapped(rig: Rig, pages: set[int], mapped: bool = True) -> None:
    be = rig.backend
    for p in pages:
        for layer in range(rig.pool.layers):
            addr = rig.pool.store.pages.address(layer, p)
            assert be.is_mapped(addr) == mapped, f"page {p} layer {layer}"


def _physical(rig: Rig) -> tuple[int, int, int]:
    """(memfd blocks, pool's own count, ledger's physical total): they must agree."""
    snap = rig.ledger.snapshot()
    return (
        rig.backend.physical_bytes(),
        rig.pool.stats()["physical_bytes"],
        snap.total("physical_bytes"),
    )


# -- alloc / free ----------------------------------------------------------------------------
def test_alloc_returns_distinct_int64_ids(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    a = rig.pool.alloc(10)
    b = rig.pool.alloc(7)
    assert a.dtype == torch.int64 and a.shape == (10,)
    ids = a.tolist() + b.tolist()
    assert len(set(ids)) == 17
    assert all(1 <= i < 64 for i in ids)
    assert sorted(rig.pool.occupied_ids()) == sorted(ids)
    assert rig.pool.stats()["occupied_slots"] == 17
    assert rig.ledger.snapshot().total("occupied_slots") == 17
    rig.pool.free(a)
    rig.pool.free(b.tolist())
    assert rig.pool.occupied_ids() == []
    assert rig.ledger.snapshot().total("occupied_slots") == 0


def test_alloc_zero_and_bad_n(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    assert rig.pool.alloc(0).shape == (0,)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="n="):
            rig.pool.alloc(bad)  # type: ignore[arg-type]  # wrong on purpose


def test_every_slot_can_be_handed_out_once_then_capacity_error(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    ids = rig.pool.alloc(63)
    assert sorted(ids.tolist()) == list(range(1, 64))
    assert _mapped_pages(rig.pool) == list(range(16))
    before = rig.state()
    with pytest.raises(CapacityError, match="cannot allocate 1 more slots"):
        rig.pool.alloc(1)
    assert rig.state() == before


def test_null_slot_is_held_and_refused(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    assert rig.pool.null_slot == 0
    assert rig.pool.capacity_slots == 63
    assert rig.pool.is_page_mapped(0)  # the null slot's page is held from the start
    assert 0 not in rig.pool.alloc(63).tolist()
    before = rig.state()
    for call in (rig.pool.free, rig.pool.occupy):
        with pytest.raises(SlotError, match="null slot"):
            call([0])
    assert rig.state() == before
    assert rig.ledger.snapshot().total("occupied_slots") == 63  # the null slot is not counted


def test_without_null_slot_slot_zero_is_ordinary(rig_factory: MakeRig) -> None:
    rig = rig_factory(null_slot=False)
    assert rig.pool.null_slot is None and rig.pool.capacity_slots == 64
    assert _mapped_pages(rig.pool) == []
    ids = rig.pool.alloc(64).tolist()
    assert 0 in ids
    rig.pool.free([0])
    rig.pool.occupy([0])


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([5], "free"),  # never allocated: a foreign id
        ([64], "out of range"),
        ([-1], "out of range"),
        ("dup", "twice"),
        ("double", "free"),
    ],
)
def test_bad_free_raises_slot_error_and_changes_nothing(
    rig_factory: MakeRig, ids: Any, match: str
) -> None:
    rig = rig_factory()
    got = rig.pool.alloc(3).tolist()  # slots 1-3 on page 0
    if ids == "dup":
        ids = [got[0], got[1], got[0]]
    elif ids == "double":
        rig.pool.free([got[2]])
        ids = [got[0], got[2]]
    before = rig.state()
    with pytest.raises(SlotError, match=match):
        rig.pool.free(ids)
    assert rig.state() == before


def test_non_int_ids_are_refused(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    before = rig.state()
    for bad in ([1.0], ["1"], object(), torch.tensor([1.5])):
        with pytest.raises(SlotError):
            rig.pool.free(bad)
    assert rig.state() == before


def test_allocation_prefers_partly_occupied_then_spare_then_new_pages(rig_factory: MakeRig) -> None:
    rig = rig_factory(max_spare_pages=2)
    pool = rig.pool
    first = pool.alloc(3 + 8).tolist()  # page 0 (beside the null slot), pages 1 and 2
    assert _pages_of(pool, first) == {0, 1, 2}
    page2 = [i for i in first if pool.layout.slot_pages(i)[0] == 2]
    page1 = [i for i in first if pool.layout.slot_pages(i)[0] == 1]
    pool.free(page2)  # page 2 becomes a spare (kept: max_spare_pages=2)
    pool.free(page1[:1])  # page 1 becomes partly occupied
    assert pool.is_page_mapped(2)
    assert pool.alloc(1).tolist() == page1[:1]  # the partly occupied page first
    again = pool.alloc(4).tolist()  # then the spare page, no new page
    assert sorted(again) == sorted(page2)
    assert _mapped_pages(pool) == [0, 1, 2]
    assert pool.stats()["live_handle_sets"] == 3
    new = pool.alloc(1).tolist()  # only now a new page
    assert _pages_of(pool, new) == {3}


def test_sync_trim_keeps_max_spare_pages_mapped(rig_factory: MakeRig) -> None:
    rig = rig_factory(max_spare_pages=2, handle_pool_pages=0)
    pool = rig.pool
    ids = pool.alloc(3 + 6 * SLOTS_PER_PAGE)
    assert len(_mapped_pages(pool)) == 7
    pool.free(ids)
    assert pool.stats()["spare_pages"] == 2
    assert _mapped_pages(pool) == [0, 1, 2]  # page 0 holds the null slot
    assert _physical(rig) == (3 * 3 * PAGE,) * 3
    _assert_backend_mapped(rig, set(range(3, 16)), mapped=False)


def test_handle_sets_are_kept_and_reused(rig_factory: MakeRig) -> None:
    rig = rig_factory(max_spare_pages=0, handle_pool_pages=2)
    pool = rig.pool
    ids = pool.alloc(3 + 3 * SLOTS_PER_PAGE)
    sets_before = [pool.store.debug_state().handles[p] for p in (1, 2, 3)]
    pool.free(ids)
    assert _mapped_pages(pool) == [0]
    stats = pool.stats()
    assert stats["kept_handle_sets"] == 2 and stats["live_handle_sets"] == 3
    # a kept set is physical memory: the memfd, the pool and the ledger all count it
    assert _physical(rig) == (3 * 3 * PAGE,) * 3
    snap = rig.ledger.snapshot()
    assert snap.total("mapped_bytes") == 3 * PAGE
    handles_before = rig.backend.stats()["handles"]
    pool.alloc(3 + 2 * SLOTS_PER_PAGE)
    assert rig.backend.stats()["handles"] == handles_before  # nothing created
    reused = {pool.store.debug_state().handles[p] or () for p in (1, 2)}
    assert reused <= {s or () for s in sets_before}
    assert pool.stats()["kept_handle_sets"] == 0


def test_a_page_with_an_occupied_slot_is_never_unmapped(rig_factory: MakeRig) -> None:
    rig = rig_factory(max_spare_pages=0, handle_pool_pages=0)
    pool = rig.pool
    ids = pool.alloc(3 + 4 * SLOTS_PER_PAGE).tolist()
    keep = [i for i in ids if pool.layout.slot_pages(i)[0] == 3][:1]
    buf = pool.buffer(1)
    off = pool.layout.slot_offset(keep[0])
    buf.view(-1)[off : off + pool.layout.slot_bytes].fill_(0x42)
    pool.free([i for i in ids if i not in keep])
    assert _mapped_pages(pool) == [0, 3]
    _assert_backend_mapped(rig, {0, 3})
    assert bool((buf.view(-1)[off : off + pool.layout.slot_bytes] == 0x42).all())


# -- physical budget -----------------------------------------------------------------------
def test_budget_refuses_and_changes_nothing(rig_factory: MakeRig) -> None:
    rig = rig_factory(physical_budget=3 * 3 * PAGE, max_spare_pages=4)
    pool = rig.pool
    pool.alloc(3 + 2 * SLOTS_PER_PAGE)  # null page + 2 more: the budget is spent
    before = rig.state()
    with pytest.raises(CapacityError, match="physical_budget"):
        pool.alloc(1)
    assert rig.state() == before


def test_budget_refusal_after_gathering_free_slots_returns_them(rig_factory: MakeRig) -> None:
    rig = rig_factory(physical_budget=3 * 3 * PAGE, max_spare_pages=4)
    pool = rig.pool
    ids = pool.alloc(3 + 2 * SLOTS_PER_PAGE).tolist()
    pool.free(ids[:2])  # two free slots on mapped pages: gathered before the budget refuses
    before = rig.state()
    with pytest.raises(CapacityError, match="physical_budget"):
        pool.alloc(3)
    assert rig.state() == before
    assert sorted(pool.alloc(2).tolist()) == sorted(ids[:2])


def test_slot_capacity_refusal_after_gathering_returns_them(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    pool = rig.pool
    ids = pool.alloc(63).tolist()
    pool.free(ids[:5])
    before = rig.state()
    with pytest.raises(CapacityError, match="cannot allocate"):
        pool.alloc(6)
    assert rig.state() == before
    assert sorted(pool.alloc(5).tolist()) == sorted(ids[:5])


def test_kept_handle_sets_count_against_the_budget(rig_factory: MakeRig) -> None:
    rig = rig_factory(physical_budget=3 * 3 * PAGE, max_spare_pages=0, handle_pool_pages=2)
    pool = rig.pool
    ids = pool.alloc(3 + 2 * SLOTS_PER_PAGE)
    pool.free(ids)  # pages 1 and 2 unmapped, their sets kept
    assert _mapped_pages(pool) == [0]
    assert pool.stats()["physical_bytes"] == 3 * 3 * PAGE
    pool.alloc(3 + 2 * SLOTS_PER_PAGE)  # fits: reuses the kept sets
    before = rig.state()
    with pytest.raises(CapacityError, match="physical_budget"):
        pool.alloc(1)
    assert rig.state() == before


def test_budget_below_one_page_id_is_refused(host: HostBackend) -> None:
    lay = SlotLayout(capacity_slots=8, slot_bytes=KIB, page_bytes=PAGE)
    with pytest.raises(ValueError, match="physical_budget=1000"):
        SwaPool(host, layers=2, layout=lay, physical_budget=1000)
    assert host.stats()["reservations"] == 0


def test_bad_watermarks_and_page_size_are_refused(host: HostBackend) -> None:
    lay = SlotLayout(capacity_slots=8, slot_bytes=KIB, page_bytes=PAGE)
    with pytest.raises(ValueError, match="min_spare_pages=3"):
        SwaPool(host, layers=2, layout=lay, min_spare_pages=3, max_spare_pages=1)
    odd = SlotLayout(capacity_slots=8, slot_bytes=KIB, page_bytes=PAGE + 4096)
    with pytest.raises(ValueError, match="page_bytes"):
        SwaPool(host, layers=2, layout=odd)
    assert host.stats()["reservations"] == 0


# -- follow mode -----------------------------------------------------------------------------
def test_occupy_maps_the_pages_of_given_ids_and_free_returns_them(rig_factory: MakeRig) -> None:
    rig = rig_factory(max_spare_pages=0, handle_pool_pages=0)
    pool = rig.pool
    chosen = [9, 10, 41, 63]  # pages 2, 2, 10, 15
    pool.occupy(torch.tensor(chosen))
    assert _mapped_pages(pool) == [0, 2, 10, 15]
    _assert_backend_mapped(rig, {2, 10, 15})
    assert sorted(pool.occupied_ids()) == chosen
    snap = rig.ledger.snapshot()
    assert snap.total("occupied_slots") == 4
    assert snap.total("mapped_bytes") == 4 * 3 * PAGE
    # alloc never hands out an occupied id
    assert not set(pool.alloc(20).tolist()) & set(chosen)
    before = rig.state()
    with pytest.raises(SlotError, match="already occupied"):
        pool.occupy([11, 9])
    assert rig.state() == before
    pool.free(chosen)
    assert not set(chosen) & set(pool.occupied_ids())


def test_occupy_over_budget_changes_nothing(rig_factory: MakeRig) -> None:
    rig = rig_factory(physical_budget=2 * 3 * PAGE)
    pool = rig.pool
    before = rig.state()
    with pytest.raises(CapacityError, match="physical_budget"):
        pool.occupy([5, 9])  # two new pages, room for one
    assert rig.state() == before
    pool.occupy([5, 6])


# -- straddling slots: DeepSeek-V4's padded rows on small pages ----------------------------
def _dsv4_layout(rows: int = 4) -> SlotLayout:
    return SlotLayout(
        capacity_slots=rows * DSV4_SLOTS_PER_ROW,
        slot_bytes=DSV4_SLOT_BYTES,
        page_bytes=PAGE,
        slots_per_row=DSV4_SLOTS_PER_ROW,
        row_bytes=DSV4_ROW_BYTES,
    )


def test_straddling_slots_map_both_pages_and_hold_their_bytes(rig_factory: MakeRig) -> None:
    lay = _dsv4_layout()
    rig = rig_factory(layers=2, layout=lay, max_spare_pages=0, handle_pool_pages=0)
    pool = rig.pool
    straddlers = [i for i in range(1, lay.capacity_slots) if len(set(lay.slot_pages(i))) == 2]
    assert len(straddlers) >= 5
    pool.occupy(straddlers[:3])
    need = _pages_of(pool, straddlers[:3]) | {0}
    assert set(_mapped_pages(pool)) == need
    _assert_backend_mapped(rig, need)
    flat = pool.buffer(1).view(-1)
    for i in straddlers[:3]:
        off = lay.slot_offset(i)
        flat[off : off + lay.slot_bytes] = torch.arange(lay.slot_bytes) % 256
    assert rig.ledger.snapshot().violations == ()
    # every other slot comes out of alloc; all slots, straddling or not, are distinct
    rest = pool.alloc(pool.capacity_slots - 3).tolist()
    assert len(set(rest) | set(straddlers[:3])) == pool.capacity_slots
    assert set(_mapped_pages(pool)) == set(range(lay.num_pages))
    for i in straddlers[:3]:
        off = lay.slot_offset(i)
        assert torch.equal(flat[off : off + lay.slot_bytes], torch.arange(lay.slot_bytes) % 256)
    pool.free(rest)
    assert set(_mapped_pages(pool)) == need  # freed pages went; the straddlers' stayed
    _assert_backend_mapped(rig, set(range(lay.num_pages)) - need, mapped=False)
    pool.free(straddlers[:3])
    assert _mapped_pages(pool) == [0]


def test_straddling_alloc_one_by_one_matches_bulk(rig_factory: MakeRig) -> None:
    lay = _dsv4_layout(rows=2)
    rig = rig_factory(layers=1, layout=lay, max_spare_pages=1)
    pool = rig.pool
    got = [pool.alloc(1).item() for _ in range(pool.capacity_slots)]
    assert sorted(got) == list(range(1, lay.capacity_slots))
    for i in got:
        for p in lay.slot_pages(i):
            assert pool.is_page_mapped(p)
    with pytest.raises(CapacityError):
        pool.alloc(1)


# -- typed views ------------------------------------------------------------------------------
def test_buffer_views_fp8_and_bf16_read_and_write_on_occupied_slots(rig_factory: MakeRig) -> None:
    lay = _dsv4_layout(rows=2)
    rig = rig_factory(layers=3, layout=lay)
    pool = rig.pool
    ids = pool.alloc(300).tolist()
    rows = [(i // DSV4_SLOTS_PER_ROW, i % DSV4_SLOTS_PER_ROW) for i in ids]
    # fp8 nope part: 448 bytes per slot at the start of the slot
    fp8 = pool.buffer(0, torch.float8_e4m3fn, (lay.rows, DSV4_ROW_BYTES))
    assert fp8.dtype == torch.float8_e4m3fn and fp8.data_ptr() == pool.tensors[0].data_ptr()
    vals = torch.linspace(-4, 4, 448).to(torch.float8_e4m3fn)
    for r, c in rows:
        fp8[r, c * DSV4_SLOT_BYTES : c * DSV4_SLOT_BYTES + 448] = vals
    bf16 = pool.buffer(2, torch.bfloat16, (lay.rows, DSV4_ROW_BYTES // 2))
    assert bf16.dtype == torch.bfloat16
    rope = torch.linspace(-1, 1, 32, dtype=torch.bfloat16)
    for r, c in rows:
        start = (c * DSV4_SLOT_BYTES + 448) // 2
        bf16[r, start : start + 32] = rope
    again8 = pool.buffer(0, torch.float8_e4m3fn, (lay.rows, DSV4_ROW_BYTES))
    again16 = pool.buffer(2, torch.bfloat16, (lay.rows, DSV4_ROW_BYTES // 2))
    for r, c in rows:
        got8 = again8[r, c * DSV4_SLOT_BYTES : c * DSV4_SLOT_BYTES + 448]
        assert torch.equal(got8.view(torch.uint8), vals.view(torch.uint8))
        start = (c * DSV4_SLOT_BYTES + 448) // 2
        assert torch.equal(again16[r, start : start + 32], rope)
    # layers are separate memory: layer 1 was never written
    assert int(pool.buffer(1)[0, : DSV4_SLOT_BYTES * 4].sum()) == 0
    default = pool.buffer(1)
    assert default.shape == (lay.rows, DSV4_ROW_BYTES) and default.dtype == torch.uint8


def test_buffer_after_close_is_refused(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    rig.pool.close()
    with pytest.raises(ClosedError):
        rig.pool.buffer(0)


# -- close ------------------------------------------------------------------------------------
def test_close_releases_everything_and_is_idempotent(rig_factory: MakeRig) -> None:
    rig = rig_factory(max_spare_pages=2, handle_pool_pages=2)
    pool = rig.pool
    ids = pool.alloc(40)
    pool.free(ids[:30])
    assert rig.backend.physical_bytes() > 0
    pool.close()
    pool.close()
    assert pool.closed
    assert rig.backend.stats() == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
    }
    assert rig.backend.physical_bytes() == 0
    snap = rig.ledger.snapshot()
    for name in ("physical_bytes", "mapped_bytes", "occupied_bytes", "occupied_slots"):
        assert snap.total(name) == 0, name
    assert snap.violations == ()
    for call in (lambda: pool.alloc(1), lambda: pool.free([1]), lambda: pool.occupy([1])):
        with pytest.raises(ClosedError):
            call()


def test_context_manager_closes(host: HostBackend) -> None:
    lay = SlotLayout(capacity_slots=16, slot_bytes=16 * KIB, page_bytes=PAGE)
    with SwaPool(host, layers=2, layout=lay) as pool:
        pool.alloc(9)
    assert pool.closed and host.stats()["handles"] == 0 and host.physical_bytes() == 0


def test_construction_failure_leaves_nothing(host: HostBackend) -> None:
    """A pool whose null page cannot be mapped closes what it had reserved."""
    lay = SlotLayout(capacity_slots=16, slot_bytes=16 * KIB, page_bytes=PAGE)
    fb = FailingBackend(host, "set_access", 1)
    with pytest.raises(Exception, match="INJECTED"):
        SwaPool(fb, layers=2, layout=lay)
    assert host.stats() == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
    }
    assert host.physical_bytes() == 0


def test_construction_failing_after_reserving_frees_the_reservations(host: HostBackend) -> None:
    """byte_tensor can fail (on CUDA: numpy missing); the reservations must not leak."""

    class NoTensors(FailingBackend):
        def byte_tensor(self, address: int, size: int) -> Any:
            raise RuntimeError("no tensors here")

    lay = SlotLayout(capacity_slots=16, slot_bytes=16 * KIB, page_bytes=PAGE)
    with pytest.raises(RuntimeError, match="no tensors"):
        SwaPool(NoTensors(host), layers=3, layout=lay)
    assert host.stats()["reservations"] == 0


def test_the_pool_runs_on_every_backend(backend: Any) -> None:
    """The pool over each backend of the contract suite (CUDA under marker gpu): slots on
    several pages, straddling ones included, written through fp8 and read back, then close()
    holds nothing."""
    g = backend.granularity
    rows = -(-3 * g // DSV4_ROW_BYTES)  # about three pages
    lay = SlotLayout(
        capacity_slots=rows * DSV4_SLOTS_PER_ROW,
        slot_bytes=DSV4_SLOT_BYTES,
        page_bytes=g,
        slots_per_row=DSV4_SLOTS_PER_ROW,
        row_bytes=DSV4_ROW_BYTES,
    )
    rig = Rig(backend, layers=2, layout=lay, max_spare_pages=0, handle_pool_pages=0)
    pool = rig.pool
    ids = pool.alloc(pool.capacity_slots)
    assert len(set(ids.tolist())) == pool.capacity_slots
    assert _mapped_pages(pool) == list(range(lay.num_pages))
    fp8 = pool.buffer(1, torch.float8_e4m3fn, (-1,))
    dev = fp8.device
    offsets = torch.tensor([lay.slot_offset(i) for i in ids.tolist()], device=dev)
    cols = offsets[:, None] + torch.arange(DSV4_SLOT_BYTES, device=dev)
    values = (ids.to(dev)[:, None] % 8 + 1).float().expand(-1, DSV4_SLOT_BYTES)
    # scatter through the uint8 view of the fp8 view (index_put on fp8 is not on every device)
    fp8.view(torch.uint8)[cols] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    again = pool.buffer(1, torch.float8_e4m3fn, (-1,))
    back = again.view(torch.uint8)[cols].view(torch.float8_e4m3fn).float()
    assert torch.equal(back.cpu(), values.cpu())
    snap = rig.ledger.snapshot()
    assert snap.violations == ()
    assert snap.total("physical_bytes") == lay.num_pages * 2 * g
    pool.free(ids)
    assert _mapped_pages(pool) == [0]
    pool.close()
    stats = backend.stats()
    assert (stats["reservations"], stats["handles"], stats["mappings"]) == (0, 0, 0)
    assert rig.ledger.snapshot().total("physical_bytes") == 0
