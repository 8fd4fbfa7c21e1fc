"""The demo's host truth and its ledger read at one instant, a map in flight or not.

The demo's background mapper makes a page id's handle set (one granule per SWA layer) and maps
it off the page store's lock; the store reports both when the map ends. A truth read at once
meanwhile saw the memfd a page id ahead of the ledger (the flaky `tests/kvledger/tools/dashboards/test_live.py`
truth panel: 43 granules, the demo's 43 SWA layers). The demo's truth reader holds the store
quiescent, so a snapshot taken while the map is held waits for it and agrees to the byte."""

from __future__ import annotations

import threading
import time

import pytest

from allocator import HostBackend
from kvledger.demo import source as demo_mod
from kvledger.demo.source import DemoOptions, DemoSource

HELD_S = 0.2  # how long the gated map is held once a snapshot is under way
BUDGET = 256 << 20  # small: the build zeroes every runtime-owned tensor


class _MapperMapGate(HostBackend):
    """A host backend whose first `map` on a background mapper's thread waits for `let_go`."""

    def __init__(self, granularity: int) -> None:
        super().__init__(granularity)
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def map(self, address: int, size: int, handle: int) -> None:
        mapper = threading.current_thread().name.startswith("kvledger-mapper-")
        if mapper and not self.entered.is_set():
            self.entered.set()
            if not self.let_go.wait(10):
                raise AssertionError("the gated map was never released")
        super().map(address, size, handle)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(demo_mod, "HostBackend", _MapperMapGate)
    demo = DemoSource(DemoOptions(budget_bytes=BUDGET, start_workload=False))
    backend = demo.backend
    assert isinstance(backend, _MapperMapGate)
    try:
        yield demo, backend
    finally:
        backend.let_go.set()
        demo.close()


def test_a_snapshot_with_a_map_in_flight_waits_for_it_and_agrees(gated) -> None:
    demo, backend = gated
    layers = len(demo.buffer_map.family_buffers("swa_kv"))
    assert backend.entered.wait(10), "the mapper never mapped a spare page"
    # the page id's handle set is made, its map not ended: the memfd is a page id ahead
    before = demo.ledger.snapshot(reconcile=False)
    vmm_before = sum(b.physical_bytes for b in before.buffers if b.spec.family == "swa_kv")
    assert backend.physical_bytes() == vmm_before + layers * backend.granularity
    threading.Timer(HELD_S, backend.let_go.set).start()
    t0 = time.monotonic()
    (rec,) = demo.ledger.snapshot().reconciliation
    waited = time.monotonic() - t0
    assert rec["source"] == "host_memfd" and rec["available"], rec
    assert rec["unattributed_bytes"] == 0, (
        f"truth {rec['device_bytes']} B vs ledger {rec['ledger_bytes']} B: "
        f"{rec['unattributed_bytes'] / backend.granularity:+.0f} granules"
    )
    assert rec["ledger_bytes"] == vmm_before + layers * backend.granularity
    assert waited >= HELD_S / 2  # it waited for the map to end
