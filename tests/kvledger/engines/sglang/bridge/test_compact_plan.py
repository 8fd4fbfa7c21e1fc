"""Compaction's next plan (kvledger.engines.sglang.bridge.compact._next_plan) on a bare page store and
follower, no SGLang: when a stale spare is all that stands over the bound, it goes and no row
moves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from allocator.host import HostBackend
from allocator.rows import packing
from kvledger.engines.sglang.bridge.compact import _next_plan
from tests.allocator.rows.rig import GRAN, make, mapped


@pytest.fixture
def host() -> Iterator[HostBackend]:
    be = HostBackend(GRAN)
    yield be
    be.close()


def test_a_stale_spare_at_the_watermark_goes_instead_of_rows_moving(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=1)
    with store:
        f.take([8, 9, 10])  # pages 0, 3, 4 in use: one beyond the two packed
        with store.lock:
            store.map_locked([20])  # the one spare, stale
            store.policy.set_ahead([22])  # a page wanted ahead: the mapper may map it in 20's place
            assert not packing.fragmented(f) and packing.over_bound_soon(f)
            assert _next_plan(f, store, 16) == ([], [])
            assert 20 not in mapped(store) and 22 not in mapped(store)
            assert not packing.over_bound_soon(f)


def test_a_pinned_spare_stays_mapped(host: HostBackend) -> None:
    store, f = make(host, max_spare_pages=1)
    with store:
        f.take([8, 9, 10])
        with store.lock:
            store.map_locked([20])
            store.policy.set_ahead([22])
            store.policy.pin([20])  # not stale: 22 cannot take its place, nothing to come
            assert packing.spares_to_come(f) == 0 and not packing.over_bound_soon(f)
            assert _next_plan(f, store, 16) == ([], [])
            assert 20 in mapped(store)
