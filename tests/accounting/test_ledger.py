"""Ledger and Account: O(1) updates from allocator events, errors on impossible figures,
accounts registered and removed, peaks, map-latency buckets, reconciliation readers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from accounting.buffers import Owner, runtime_buffer
from accounting.events import PoolEvent
from accounting.ledger import MAP_SECONDS_BUCKETS, Ledger, LedgerError
from accounting.tp_status import TpStatus
from tests.accounting.helpers import PAGE, runtime_specs, vmm_account, vmm_specs


def test_events_move_the_figures_of_every_layer_buffer() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger, layers=3)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 4)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 3, 0.003)
    acc.on_pool_event(PoolEvent.SLOTS_OCCUPIED, 100)
    snap = ledger.snapshot()
    assert [b.physical_bytes for b in snap.buffers] == [4 * PAGE] * 3
    assert [b.mapped_bytes for b in snap.buffers] == [3 * PAGE] * 3
    assert [b.occupied_bytes for b in snap.buffers] == [100 * 584] * 3
    assert snap.total("physical_bytes") == 12 * PAGE
    assert snap.total("mapped_bytes") == 9 * PAGE
    assert snap.total("occupied_slots") == 100  # slots count once per index space
    assert snap.total("occupied_bytes") == 3 * 100 * 584
    acc.on_pool_event(PoolEvent.SLOTS_FREED, 100)
    acc.on_pool_event(PoolEvent.PAGES_UNMAPPED, 3, 0.002)
    acc.on_pool_event(PoolEvent.HANDLES_RELEASED, 4)
    snap = ledger.snapshot()
    for name in ("physical_bytes", "mapped_bytes", "occupied_bytes", "occupied_slots"):
        assert snap.total(name) == 0
    row = snap.accounts[0]
    assert (row.pages_mapped_total, row.pages_unmapped_total) == (3, 3)
    assert (row.peak_handle_pages, row.peak_occupied_slots) == (4, 100)
    assert row.map_seconds_total == pytest.approx(0.003)
    assert row.unmap_seconds_total == pytest.approx(0.002)


class _NoIteration(tuple):
    def __iter__(self) -> Any:
        raise AssertionError("an event walked the buffers: updates must be O(1)")


def test_event_updates_are_o1_they_never_walk_buffers_or_other_accounts() -> None:
    ledger = Ledger()
    accounts = [vmm_account(ledger, pool=f"p{i}", layers=40) for i in range(20)]
    acc = accounts[7]
    for other in accounts:
        other.buffers = _NoIteration(other.buffers)
    ledger._accounts = _ExplodingDict(ledger._accounts)
    for event, n in [
        (PoolEvent.HANDLES_CREATED, 2),
        (PoolEvent.PAGES_MAPPED, 2),
        (PoolEvent.SLOTS_OCCUPIED, 5),
        (PoolEvent.SLOTS_FREED, 5),
        (PoolEvent.PAGES_UNMAPPED, 2),
        (PoolEvent.HANDLES_RELEASED, 2),
    ]:
        acc.on_pool_event(event, n)
    assert acc.handle_pages == acc.mapped_pages == acc.occupied_slots == 0


class _ExplodingDict(dict):
    def values(self) -> Any:
        raise AssertionError("an event walked the accounts: updates must be O(1)")

    def __iter__(self) -> Any:
        raise AssertionError("an event walked the accounts: updates must be O(1)")


@pytest.mark.parametrize(
    ("setup", "event", "count", "match"),
    [
        ([], PoolEvent.SLOTS_FREED, 1, "occupied_slots=-1"),
        ([], PoolEvent.HANDLES_RELEASED, 1, "handle_pages=-1"),
        ([], PoolEvent.PAGES_UNMAPPED, 1, "mapped_pages=-1"),
        ([], PoolEvent.SLOTS_OCCUPIED, -3, "count=-3"),
        ([(PoolEvent.SLOTS_OCCUPIED, 4000)], PoolEvent.SLOTS_OCCUPIED, 97, "capacity_slots=4096"),
    ],
)
def test_impossible_figures_raise_ledger_error_and_change_nothing(
    setup: list[tuple[PoolEvent, int]], event: PoolEvent, count: int, match: str
) -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    for e, n in setup:
        acc.on_pool_event(e, n)
    before, epoch = ledger.snapshot(), ledger.epoch
    with pytest.raises(LedgerError, match=match):
        acc.on_pool_event(event, count)
    after = ledger.snapshot()
    assert ledger.epoch == epoch
    assert after.accounts == before.accounts and after.buffers == before.buffers


def test_page_events_on_a_runtime_account_are_refused() -> None:
    ledger = Ledger()
    acc = ledger.add_account(runtime_specs("c4", "c4_kv", 2))
    for event in (PoolEvent.HANDLES_CREATED, PoolEvent.PAGES_MAPPED):
        with pytest.raises(LedgerError, match="runtime-owned"):
            acc.on_pool_event(event, 1)


def test_runtime_account_holds_its_storage_and_reports_occupancy() -> None:
    ledger = Ledger()
    t = torch.zeros(256, 2048, dtype=torch.float32)
    spec = runtime_buffer(t, name="c4_state.0", family="c4_attn_state", pool="c4", layer=0)
    assert spec.owner is Owner.RUNTIME
    assert spec.tensor_bytes == spec.reserved_bytes == 256 * 2048 * 4
    assert (spec.capacity_slots, spec.slot_bytes, spec.dtype) == (256, 2048 * 4, "float32")
    acc = ledger.add_account([spec])
    acc.occupy(10)
    acc.occupy(6)
    acc.release(4)
    snap = ledger.snapshot()
    assert snap.total("physical_bytes") == snap.total("tensor_bytes") == 256 * 2048 * 4
    assert snap.total("occupied_slots") == 12
    assert snap.total("occupied_bytes") == 12 * 2048 * 4
    assert snap.violations == ()


def test_epoch_counts_every_applied_change() -> None:
    ledger = Ledger()
    assert ledger.epoch == 0
    acc = vmm_account(ledger)
    assert ledger.epoch == 1
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 1)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1)
    assert ledger.epoch == 3
    s1 = ledger.snapshot()
    assert s1.epoch == 3
    assert ledger.snapshot().epoch == 3  # taking a snapshot changes nothing
    acc.on_pool_event(PoolEvent.PAGES_UNMAPPED, 1)
    acc.on_pool_event(PoolEvent.HANDLES_RELEASED, 1)
    ledger.remove_account(acc)
    assert ledger.epoch == 6
    assert ledger.snapshot().epoch == 6


def test_add_account_validation() -> None:
    ledger = Ledger()
    with pytest.raises(ValueError, match="empty"):
        ledger.add_account([])
    mixed = vmm_specs("swa", "swa_kv", 1) + vmm_specs("swa", "c4_kv", 1)
    with pytest.raises(ValueError, match="c4_kv"):
        ledger.add_account(mixed, page_bytes=PAGE)
    with pytest.raises(ValueError, match="page_bytes=0"):
        ledger.add_account(vmm_specs("swa", "swa_kv", 1))
    vmm_account(ledger)
    with pytest.raises(ValueError, match="already registered"):
        vmm_account(ledger)
    with pytest.raises(ValueError, match="already registered"):
        ledger.add_account(vmm_specs("swa", "swa_kv", 1), key="other", page_bytes=PAGE)
    assert len(ledger.accounts()) == 1


def test_remove_account_refuses_one_that_still_holds_memory() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 1)
    with pytest.raises(LedgerError, match="handle_pages=1"):
        ledger.remove_account(acc)
    acc.on_pool_event(PoolEvent.HANDLES_RELEASED, 1)
    ledger.remove_account(acc)
    assert ledger.accounts() == ()
    with pytest.raises(ValueError, match="not registered"):
        ledger.remove_account(acc)
    vmm_account(ledger)  # the same buffers may be registered again


def test_map_latency_histogram_is_per_page_id() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 20)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 10, 0.016)  # 1.6 ms per page id
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1, 0.00004)  # 40 us
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1, 1.0)  # beyond the last bucket
    row = ledger.snapshot().accounts[0]
    counts = row.map_bucket_counts
    assert len(counts) == len(MAP_SECONDS_BUCKETS) + 1
    # each page id of an operation observes its share: 10 page ids at 1.6 ms
    assert counts[MAP_SECONDS_BUCKETS.index(0.0025)] == 10
    assert counts[0] == 1
    assert counts[-1] == 1
    # so the buckets add up to the page ids mapped, the observations to the seconds
    assert sum(counts) == row.pages_mapped_total == 12
    assert row.map_seconds_total == pytest.approx(0.016 + 0.00004 + 1.0)
    # a value on a bound falls in that bound's bucket (Prometheus "le")
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1, 0.001)
    assert ledger.snapshot().accounts[0].map_bucket_counts[MAP_SECONDS_BUCKETS.index(0.001)] == 1
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 0, 0.0)  # nothing mapped: nothing observed
    assert sum(ledger.snapshot().accounts[0].map_bucket_counts) == 13


def test_snapshot_is_taken_at_one_moment_under_concurrent_events() -> None:
    """An event reported while a snapshot is being taken waits for it: the snapshot is the
    ledger as of one moment. The TP status source (read under the lock, before the rows)
    has another thread report page events while the snapshot is half taken, and gives it
    up to 0.5 s: with the lock held they cannot land, and every figure, the epoch and
    every buffer row are those of before; they land once the snapshot is done."""
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 2)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1)
    before, epoch = ledger.snapshot(), ledger.epoch
    landed = threading.Event()

    def churn() -> None:
        acc.on_pool_event(PoolEvent.HANDLES_CREATED, 1)
        acc.on_pool_event(PoolEvent.PAGES_MAPPED, 2)
        acc.on_pool_event(PoolEvent.SLOTS_OCCUPIED, 3)
        landed.set()

    racer = threading.Thread(target=churn)
    waited: list[bool] = []

    def tp_status() -> TpStatus:
        if not racer.is_alive() and not waited:
            racer.start()
            waited.append(landed.wait(0.5))  # False: the events waited for the lock
        return TpStatus(rank=0, size=1, exchanges_total=0, page_ops_total=0,
                        divergences_total=0, peer_failures_total=0)  # fmt: skip

    ledger.set_tp_status(tp_status)
    epoch += 1  # set_tp_status is a change of its own
    try:
        snap = ledger.snapshot()
    finally:
        racer.join(10)
    assert waited == [False], "events landed while the snapshot was being taken"
    assert snap.epoch == epoch
    assert snap.accounts[0] == before.accounts[0]
    assert snap.violations == ()
    row = snap.accounts[0]
    for b in snap.buffers:  # buffer rows derive from the same counters as the account row
        assert b.physical_bytes == row.handle_pages * PAGE
        assert b.mapped_bytes == row.mapped_pages * PAGE
        assert b.occupied_slots == row.occupied_slots
    after = ledger.snapshot().accounts[0]  # then they landed, all three
    assert (after.handle_pages, after.mapped_pages, after.occupied_slots) == (3, 3, 3)


def test_reconciliation_readers_run_per_snapshot_with_the_snapshot() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 2)
    seen: list[int] = []

    def reader(snap: Any) -> dict[str, Any]:
        seen.append(snap.total("physical_bytes"))
        return {"source": "test", "device_bytes": 2 * 3 * PAGE}

    ledger.add_truth(reader)
    snap = ledger.snapshot()
    assert seen == [6 * PAGE]
    assert snap.reconciliation == ({"source": "test", "device_bytes": 6 * PAGE},)
    assert ledger.snapshot(reconcile=False).reconciliation == ()
    assert seen == [6 * PAGE]


@pytest.mark.parametrize(
    ("occupied", "peak", "match"),
    [(-1, 0, "occupied=-1"), (5, 4, "occupied=5 peak=4"), (10, 4097, "capacity_slots=4096")],
)
def test_an_impossible_slot_report_raises_and_changes_nothing(
    occupied: int, peak: int, match: str
) -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_slots(7, 9)
    before, epoch = ledger.snapshot(), ledger.epoch
    with pytest.raises(LedgerError, match=match):
        acc.on_slots(occupied, peak)
    assert ledger.epoch == epoch and ledger.snapshot().accounts == before.accounts


def test_a_slot_report_sets_the_figure_and_raises_the_peak_only() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    acc.on_slots(7, 9)
    acc.on_slots(3, 5)
    [row] = ledger.snapshot().accounts
    assert (row.occupied_slots, row.peak_occupied_slots) == (3, 9)


def test_one_allocator_attaches_to_an_account_and_the_snapshot_flushes_it() -> None:
    ledger = Ledger()
    acc = vmm_account(ledger)
    pending = [5]

    def flush() -> None:
        if pending:
            acc.on_slots(pending[0], pending.pop())

    acc.attach(flush)
    acc.attach(flush)  # the same allocator again: fine
    with pytest.raises(LedgerError, match="already attached"):
        acc.attach(lambda: None)
    assert ledger.snapshot().accounts[0].occupied_slots == 5
    with pytest.raises(LedgerError, match="still attached"):
        ledger.remove_account(acc)
    acc.detach(lambda: None)  # not the attached one: ignored
    pending.append(2)
    assert ledger.snapshot().accounts[0].occupied_slots == 2  # still flushed by `flush`
    acc.on_slots(0, 0)
    acc.detach(flush)
    ledger.remove_account(acc)


def test_clear_event_hook_removes_only_the_hook_it_is_given() -> None:
    ledger = Ledger()
    calls: list[str] = []

    def mine() -> None:
        calls.append("mine")

    def theirs() -> None:
        calls.append("theirs")

    ledger.set_event_hook(mine, every=1)
    assert ledger.clear_event_hook(theirs) is False and ledger.event_hook is mine
    assert ledger.clear_event_hook(mine) is True and ledger.event_hook is None
    assert ledger.clear_event_hook(mine) is False
    acc = vmm_account(ledger)
    acc.occupy(1)
    assert calls == []  # cleared: no hook runs


def test_slots_per_count_scales_every_slot_count_and_nothing_else() -> None:
    """An allocator that hands out rows of 256 slots reports rows; the account counts slots."""
    ledger = Ledger()
    acc = ledger.add_account(vmm_specs("swa", "swa_kv", 2), page_bytes=PAGE, slots_per_count=256)
    assert acc.slots_per_count == 256
    acc.on_pool_event(PoolEvent.SLOTS_OCCUPIED, 3)
    acc.on_pool_event(PoolEvent.SLOTS_FREED, 1)
    acc.on_pool_event(PoolEvent.HANDLES_CREATED, 2)
    acc.on_pool_event(PoolEvent.PAGES_MAPPED, 2, 0.001)
    [row] = ledger.snapshot().accounts
    assert (row.occupied_slots, row.peak_occupied_slots) == (512, 768)
    assert (acc.handle_pages, acc.mapped_pages, acc.pages_mapped_total) == (2, 2, 2)
    acc.on_slots(5, 6)
    [row] = ledger.snapshot().accounts
    assert (row.occupied_slots, row.peak_occupied_slots) == (5 * 256, 6 * 256)
    acc.occupy(1)
    acc.release(6)
    assert acc.occupied_slots == 0
    with pytest.raises(LedgerError, match="capacity_slots=4096"):
        acc.on_slots(16, 17)  # 17 x 256 slots > 4096
    with pytest.raises(LedgerError, match="capacity_slots=4096"):
        acc.occupy(17)
    acc.on_pool_event(PoolEvent.PAGES_UNMAPPED, 2)
    acc.on_pool_event(PoolEvent.HANDLES_RELEASED, 2)
    ledger.remove_account(acc)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_slots_per_count_must_be_a_positive_int(bad: Any) -> None:
    ledger = Ledger()
    with pytest.raises(ValueError, match=rf"slots_per_count={bad!r}, expected a positive int"):
        ledger.add_account(vmm_specs("swa", "swa_kv", 1), page_bytes=PAGE, slots_per_count=bad)
    assert ledger.accounts() == ()
