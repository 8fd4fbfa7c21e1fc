"""The host truth and the ledger read at one instant (issue 23's one-page ledger gap): while
the background mapper has a page's handle set made but its map not ended (off the store's
lock), the memfd already holds the set and the ledger does not; a snapshot whose truth
reader holds the store quiescent waits for the call and agrees to the byte."""

from __future__ import annotations

import threading
import time
from typing import Any

from accounting.reconcile import host_memfd_truth
from allocator import BackgroundMapper, HostBackend
from allocator.slots.layout import SlotLayout
from tests.allocator.rigs import SMALL_GRANULARITY, Rig

PAGE = SMALL_GRANULARITY


class _GatedMap:
    """Delegates to a host backend; the `map` at `gate_address` waits for `release`."""

    def __init__(self, inner: HostBackend) -> None:
        self.inner = inner
        self.name = "gated"
        self.granularity = inner.granularity
        self.gate_address = -1
        self.entered = threading.Event()
        self.release = threading.Event()

    def map(self, address: int, size: int, handle: int) -> None:
        if address == self.gate_address:
            self.entered.set()
            assert self.release.wait(10)
        self.inner.map(address, size, handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _rig(quiesce: bool) -> tuple[Rig, _GatedMap, HostBackend]:
    host = HostBackend(PAGE)
    gated = _GatedMap(host)
    layout = SlotLayout(capacity_slots=64, slot_bytes=16 * 1024, page_bytes=PAGE)
    rig = Rig(gated, layers=2, layout=layout, min_spare_pages=1, max_spare_pages=1)
    store = rig.pool.store
    gated.gate_address = store.pages.address(1, 1)  # layer 1 of page 1: both sets made
    rig.ledger.add_truth(
        host_memfd_truth(host.physical_bytes, store.quiescent if quiesce else None)
    )
    return rig, gated, host


def test_a_snapshot_during_a_map_in_flight_waits_for_it_and_agrees() -> None:
    rig, gated, host = _rig(quiesce=True)
    try:
        with BackgroundMapper(rig.pool, idle_seconds=0.01):
            assert gated.entered.wait(10)  # page 1's handles made, its map not ended
            assert host.physical_bytes() == 2 * 2 * PAGE  # page 0 (null slot) and page 1
            threading.Timer(0.2, gated.release.set).start()
            t0 = time.monotonic()
            (rec,) = rig.ledger.snapshot().reconciliation
            assert time.monotonic() - t0 >= 0.1  # it waited for the map to end
            assert rec["device_bytes"] == rec["ledger_bytes"] == 2 * 2 * PAGE
            assert rec["unattributed_bytes"] == 0
    finally:
        gated.release.set()
        rig.close()
        host.close()


def test_without_quiesce_the_same_snapshot_reads_the_device_a_page_id_ahead() -> None:
    """What the bench's snapshots saw (181 of 2,000 by +8 MiB): the reader that reads at once."""
    rig, gated, host = _rig(quiesce=False)
    try:
        with BackgroundMapper(rig.pool, idle_seconds=0.01):
            assert gated.entered.wait(10)
            (rec,) = rig.ledger.snapshot().reconciliation
            gated.release.set()
            assert rec["unattributed_bytes"] == 2 * PAGE  # one page id: a set of 2 layers
    finally:
        gated.release.set()
        rig.close()
        host.close()
