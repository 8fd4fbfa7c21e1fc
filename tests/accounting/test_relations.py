"""Relations of docs/background.md#the-four-figures: a violated one is reported in the snapshot, never clamped."""

from __future__ import annotations

import dataclasses

from accounting.buffers import BufferSpec, Owner
from accounting.events import PoolEvent
from accounting.figures import HOLDER_RELATION
from accounting.ledger import Ledger
from accounting.relations import Violation, check_account, check_buffer
from accounting.rows import AccountRow, BufferRow
from tests.accounting.helpers import PAGE, vmm_account, vmm_specs


def _relations(ledger: Ledger) -> set[str]:
    return {v.relation for v in ledger.snapshot().violations}


def test_a_consistent_ledger_has_no_violations() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 2)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1)
    acc.on_pool_event(PoolEvent.SLOTS_OCCUPIED, 3000)  # 3000 * 584 < 2 MiB
    assert ledger.snapshot().violations == ()


def test_mapped_beyond_physical_is_reported_with_the_counted_values() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger, layers=2)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 1)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 3)
    snap = ledger.snapshot()
    assert "mapped_bytes <= physical_bytes" in {v.relation for v in snap.violations}
    assert "mapped_pages <= handle_pages" in {v.relation for v in snap.violations}
    # not clamped: the figures are what was counted
    assert snap.total("mapped_bytes") == 2 * 3 * PAGE
    assert snap.total("physical_bytes") == 2 * 1 * PAGE
    v = next(v for v in snap.violations if v.relation == "mapped_bytes <= physical_bytes")
    assert v.subject == "swa/swa_kv.0"
    assert str(3 * PAGE) in v.detail and str(PAGE) in v.detail
    per_buffer = [v for v in snap.violations if v.relation == "mapped_bytes <= physical_bytes"]
    assert len(per_buffer) == 2  # one per layer buffer


def test_occupied_beyond_mapped_is_reported() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_pool_event(PoolEvent.SLOTS_OCCUPIED, 1)
    assert "occupied_bytes <= mapped_bytes" in _relations(ledger)
    assert ledger.snapshot().total("occupied_slots") == 1


def test_mapped_beyond_reserved_is_reported() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger, reserved_pages=2)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 3)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 3)
    assert _relations(ledger) == {"mapped_bytes <= reserved_bytes"}


def test_tensor_beyond_reserved_is_reported() -> None:
    spec = vmm_specs("swa", "swa_kv", 1, capacity=8192, slot_bytes=1024, reserved_pages=1)[0]
    ledger = Ledger()
    ledger.add_account([spec], page_bytes=PAGE)
    assert _relations(ledger) == {"tensor_bytes <= reserved_bytes"}


def _row(**kw: int) -> BufferRow:
    spec = BufferSpec(
        name="b",
        family="swa_kv",
        pool="swa",
        owner=Owner.VMM,
        layer=0,
        dtype="uint8",
        shape=(8, 8),
        slot_bytes=8,
        capacity_slots=8,
        tensor_bytes=64,
        reserved_bytes=4 * PAGE,
    )
    base = {"physical_bytes": 2 * PAGE, "mapped_bytes": PAGE, "occupied_slots": 1}
    base.update(kw)
    return BufferRow(spec=spec, account="swa/swa_kv", page_bytes=PAGE, **base)


def test_check_buffer_reports_negatives_and_partial_pages() -> None:
    assert check_buffer(_row()) == []
    rels = {v.relation for v in check_buffer(_row(physical_bytes=PAGE + 4096))}
    assert rels == {"physical_bytes is a whole number of pages"}
    rels = {v.relation for v in check_buffer(_row(mapped_bytes=-PAGE))}
    assert "mapped_bytes >= 0" in rels
    rels = {v.relation for v in check_buffer(_row(occupied_slots=9))}
    assert "occupied_slots <= capacity_slots" in rels


def test_check_account_reports_each_relation() -> None:
    row = AccountRow(
        key="k",
        family="swa_kv",
        pool="swa",
        owner=Owner.VMM,
        page_bytes=PAGE,
        capacity_slots=10,
        occupied_slots=11,
        peak_occupied_slots=11,
        handle_pages=1,
        peak_handle_pages=1,
        mapped_pages=2,
        pages_mapped_total=2,
        pages_unmapped_total=0,
        map_seconds_total=0.0,
        unmap_seconds_total=0.0,
        map_calls=1,
        map_bucket_counts=(1,),
        held_unattributed=11,
    )
    rels = {v.relation for v in check_account(row)}
    assert rels == {"mapped_pages <= handle_pages", "occupied_slots <= capacity_slots"}


def test_the_holders_must_add_up_to_occupied_slots() -> None:
    ok = AccountRow(
        key="k", family="swa_kv", pool="swa", owner=Owner.RUNTIME, page_bytes=0,
        capacity_slots=10, occupied_slots=7, peak_occupied_slots=7, handle_pages=0,
        peak_handle_pages=0, mapped_pages=0, pages_mapped_total=0, pages_unmapped_total=0,
        map_seconds_total=0.0, unmap_seconds_total=0.0, map_calls=0, map_bucket_counts=(0,),
        held_tree_protected=2, held_tree_evictable=3, held_request_only=2,
    )  # fmt: skip
    assert check_account(ok) == []
    bad = dataclasses.replace(ok, held_request_only=3)
    (v,) = check_account(bad)
    assert v.relation == HOLDER_RELATION
    assert "sum to 8, occupied_slots=7" in v.detail


def test_violation_round_trips() -> None:
    v = Violation("s", "a <= b", "a=2 > b=1")
    assert Violation.from_dict(v.to_dict()) == v
