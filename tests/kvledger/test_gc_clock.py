"""kvledger/gc_clock.py: collections timed while installed, none after close."""

from __future__ import annotations

import gc

from kvledger.gc_clock import GcClock


def _garbage() -> None:
    for _ in range(200):
        a: list = []
        a.append(a)  # a cycle: only the collector frees it


def test_collections_are_counted_and_timed_while_installed_and_not_after_close() -> None:
    before = len(gc.callbacks)
    with GcClock() as clock:
        _garbage()
        gc.collect()
        assert clock.count >= 1
        assert clock.seconds > 0
        seen = clock.count, clock.seconds
    assert len(gc.callbacks) == before
    gc.collect()
    assert (clock.count, clock.seconds) == seen
    clock.close()  # idempotent
    assert len(gc.callbacks) == before
