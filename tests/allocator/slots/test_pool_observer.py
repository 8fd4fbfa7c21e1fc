"""What SwaPool tells its observer, and when (accounting.events): page events as they happen,
the slot figure as the pool's own count before each page event, every REPORT_EVERY calls and
on a flush, so an allocation that changes no page calls the observer not at all."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from accounting.events import PoolEvent
from accounting.ledger import Account, Ledger, LedgerError
from accounting.publisher import Publisher
from allocator.host import HostBackend
from allocator.reporting import REPORT_EVERY
from allocator.slots.layout import SlotLayout
from allocator.slots.pool import SwaPool
from tests.allocator.rigs import KIB, SMALL_GRANULARITY, pool_account

LAYOUT = SlotLayout(capacity_slots=64, slot_bytes=16 * KIB, page_bytes=SMALL_GRANULARITY)


class Recorder:
    """Forwards to a ledger account and records every call, with whether the pool's lock was
    held by the calling thread."""

    def __init__(self, target: Account) -> None:
        self.target = target
        self.pool: SwaPool | None = None
        self.calls: list[tuple[Any, ...]] = []

    def _locked(self) -> bool:
        """Whether the pool's lock is held (the tests call the pool from one thread: by the
        calling thread): another thread cannot take it."""
        if self.pool is None:
            return False
        lock = self.pool.store.lock
        free: list[bool] = []

        def probe() -> None:
            if lock.acquire(blocking=False):
                lock.release()
                free.append(True)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return not free

    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        self.calls.append(("event", event, count, self._locked()))
        self.target.on_pool_event(event, count, seconds)

    def on_slots(self, occupied: int, peak: int) -> None:
        self.calls.append(("slots", occupied, peak, self._locked()))
        self.target.on_slots(occupied, peak)

    def attach(self, flush: Callable[[], None]) -> None:
        self.calls.append(("attach",))
        self.target.attach(flush)

    def detach(self, flush: Callable[[], None]) -> None:
        self.calls.append(("detach",))
        self.target.detach(flush)

    def at_safe_point(self) -> None:
        self.calls.append(("safe_point", self._locked()))
        self.target.at_safe_point()

    def take(self) -> list[tuple[Any, ...]]:
        out, self.calls = self.calls, []
        return out


@pytest.fixture
def recorded():
    backend = HostBackend(SMALL_GRANULARITY)
    ledger = Ledger()
    account = pool_account(ledger, 2, LAYOUT)
    rec = Recorder(account)
    pool = SwaPool(backend, layers=2, layout=LAYOUT, observer=rec, max_spare_pages=1)
    rec.pool = pool
    try:
        yield ledger, account, rec, pool
    finally:
        pool.close()
        backend.close()


def test_allocations_that_change_no_page_call_the_observer_not_at_all(recorded) -> None:
    _ledger, account, rec, pool = recorded
    held = pool.alloc(2)  # slot 0 is the null slot: slots 1-2 share page 0 with it
    rec.take()
    for _ in range(REPORT_EVERY // 2 - 1):  # fewer calls than one report interval
        nxt = pool.alloc(1)
        pool.free(held)
        held = nxt
    assert rec.take() == []
    assert account._occupied_slots == 0  # the ledger has not been told yet...
    assert account.occupied_slots == 1  # ...and reading the figure asks the pool
    assert rec.take() == [("slots", 1, 3, True)]  # 3 held at the loop's first alloc


def test_slots_are_reported_before_the_page_event_that_follows_them(recorded) -> None:
    ledger, _account, rec, pool = recorded
    a = pool.alloc(3)  # slots 1-3: page 0 full with the null slot
    rec.take()
    b = pool.alloc(4)  # page 1 must be mapped
    assert [c[:2] for c in rec.take()] == [
        ("slots", 3),
        ("event", PoolEvent.HANDLES_CREATED),
        ("event", PoolEvent.PAGES_MAPPED),
    ]
    pool.free(b)  # page 1 empties: a spare (max_spare_pages=1) stays mapped
    pool.free(a)
    pool.alloc(4)  # reuses page 0's three free slots and page 1's spare: no page event
    assert rec.take() == []
    snap = ledger.snapshot()
    acc = snap.accounts[0]
    assert (acc.occupied_slots, acc.peak_occupied_slots) == (4, 7)  # the peak in between
    assert all(locked for kind, *_, locked in rec.take() if kind == "slots")


def test_every_report_every_calls_the_pool_reports_and_runs_a_safe_point_unlocked(
    recorded,
) -> None:
    _, account, rec, pool = recorded
    held = pool.alloc(1)
    rec.take()
    for _ in range(REPORT_EVERY):
        nxt = pool.alloc(1)
        pool.free(held)
        held = nxt
    calls = rec.take()
    # 1 + 2 * REPORT_EVERY calls: safe points at the REPORT_EVERY-th and the 2 * REPORT_EVERY-th,
    # each an alloc (2 held); the second finds nothing new to report
    assert [c for c in calls if c[0] == "safe_point"] == [("safe_point", False)] * 2
    assert calls == [("slots", 2, 2, True), ("safe_point", False), ("safe_point", False)]
    assert account._occupied_slots == 2
    assert account.occupied_slots == 1


def test_epoch_and_snapshot_read_exact_figures(recorded) -> None:
    ledger, _, _, pool = recorded
    before = ledger.epoch
    pool.alloc(1)
    after = ledger.epoch
    assert after == before + 1
    assert ledger.snapshot().epoch == after  # nothing changed since: same epoch
    assert ledger.snapshot().accounts[0].occupied_slots == 1


def test_close_reports_zero_and_detaches_so_the_account_can_be_removed(recorded) -> None:
    ledger, account, rec, pool = recorded
    pool.alloc(10)
    with pytest.raises(LedgerError, match="still attached"):
        ledger.remove_account(account)
    pool.close()
    calls = rec.take()
    assert ("slots", 0, 10, True) in calls and ("detach",) in calls
    assert account._flush is None and account.occupied_slots == 0
    ledger.remove_account(account)


def test_an_account_follows_one_allocator() -> None:
    ledger = Ledger()
    account = pool_account(ledger, 1, LAYOUT)
    with (
        HostBackend(SMALL_GRANULARITY) as be,
        SwaPool(be, layers=1, layout=LAYOUT, observer=account),
    ):
        with pytest.raises(LedgerError, match="already attached"):
            SwaPool(be, layers=1, layout=LAYOUT, observer=account, null_slot=False)
        assert be.stats()["reservations"] == 1  # the refused pool gave its reservation back


def test_snapshots_from_any_thread_never_deadlock_with_allocation() -> None:
    """Lock order: a pool's lock, then the ledger's. Snapshots from another thread, and from a
    thread holding the pool's lock, run beside allocating threads and the background mapper."""
    from allocator.mapper import BackgroundMapper

    ledger = Ledger()
    account = pool_account(ledger, 2, LAYOUT)
    errors: list[BaseException] = []
    stop = threading.Event()
    with (
        HostBackend(SMALL_GRANULARITY) as be,
        SwaPool(
            be, layers=2, layout=LAYOUT, observer=account, min_spare_pages=1, max_spare_pages=2
        ) as pool,
        BackgroundMapper(pool, idle_seconds=0.001),
    ):

        def allocating() -> None:
            try:
                while not stop.is_set():
                    ids = pool.alloc(7)
                    pool.free(ids)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        def snapshotting() -> None:
            try:
                while not stop.is_set():
                    snap = ledger.snapshot()
                    assert snap.violations == ()
                    with pool.store.lock:
                        assert (
                            ledger.snapshot().accounts[0].occupied_slots
                            == (pool.stats()["occupied_slots"])
                        )
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=f) for f in (allocating, allocating, snapshotting)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads), "deadlocked"
        assert errors == []
        assert ledger.snapshot().accounts[0].occupied_slots == 0


def test_a_busy_pool_publishes_from_its_allocating_thread(tmp_path, monkeypatch) -> None:
    ledger = Ledger({"tp_rank": "0"})
    account = pool_account(ledger, 2, LAYOUT)
    who: list[str] = []
    real = Publisher.publish

    def recording(self: Publisher) -> Any:
        who.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Publisher, "publish", recording)
    with (
        HostBackend(SMALL_GRANULARITY) as be,
        SwaPool(be, layers=2, layout=LAYOUT, observer=account) as pool,
        Publisher(ledger, tmp_path, interval=0.05) as pub,
    ):
        held = pool.alloc(1)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            nxt = pool.alloc(1)
            pool.free(held)
            held = nxt
        assert who.count("MainThread") >= 6  # about one per 50 ms, at the pool's safe points
        assert all(name == "MainThread" for name in who)
        assert pub.publish().accounts[0].occupied_slots == 1  # a snapshot asks the pool
