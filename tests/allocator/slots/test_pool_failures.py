"""Failure injection: a backend call failing at any point of a multi-layer page map or a
multi-page allocation leaves the pool, the backend and the ledger exactly as before, and the
pool keeps working."""

from __future__ import annotations

import pytest

from allocator.errors import DriverError
from allocator.host import HostBackend
from allocator.mapper import BackgroundMapper
from allocator.slots.layout import SlotLayout
from tests.allocator.rigs import KIB, SMALL_GRANULARITY, FailingBackend, Rig

LAYERS = 4
SLOTS_PER_PAGE = 4
LAYOUT = SlotLayout(capacity_slots=64, slot_bytes=16 * KIB, page_bytes=SMALL_GRANULARITY)
OPS = ["create", "map", "set_access"]


def _rig(host: HostBackend, **options: object) -> tuple[FailingBackend, Rig]:
    fb = FailingBackend(host)
    return fb, Rig(fb, layers=LAYERS, layout=LAYOUT, **options)  # type: ignore[arg-type]


def _calls_of(host: HostBackend, op: str, action: str, **options: object) -> int:
    """How many calls of `op` the action makes when nothing fails."""
    fb, rig = _rig(host, **options)
    _prepare(rig, action)
    fb.arm(None, None)
    _act(rig, action)
    n = fb.calls.get(op, 0)
    rig.close()
    return n


def _prepare(rig: Rig, action: str) -> None:
    if action == "alloc with kept sets":
        ids = rig.pool.alloc(3 + 2 * SLOTS_PER_PAGE)  # pages 1, 2
        rig.pool.free(ids)  # unmapped, their handle sets kept
        assert rig.pool.stats()["kept_handle_sets"] == 2
    else:
        rig.pool.alloc(2)  # a partly occupied page 0 whose slots get gathered first


def _act(rig: Rig, action: str) -> None:
    if action == "occupy":
        rig.pool.occupy([9, 20, 21, 40])  # pages 2, 5, 10
    else:
        rig.pool.alloc(3 + 3 * SLOTS_PER_PAGE)  # page 0's rest and three new page ids


ACTIONS = ["alloc", "alloc with kept sets", "occupy"]
OPTIONS: dict[str, dict[str, object]] = {
    "alloc": {"max_spare_pages": 1},
    "alloc with kept sets": {"max_spare_pages": 0, "handle_pool_pages": 2},
    "occupy": {"max_spare_pages": 1},
}


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("op", OPS)
def test_a_call_failing_at_any_point_changes_nothing(
    host: HostBackend, op: str, action: str
) -> None:
    total = _calls_of(host, op, action, **OPTIONS[action])
    if op == "create" and action == "alloc with kept sets":
        assert total == LAYERS  # two sets reused, one created
    else:
        assert total >= 3 * LAYERS, (op, action, total)
    for k in range(total):
        fb, rig = _rig(host, **OPTIONS[action])
        _prepare(rig, action)
        before = rig.state()
        failures = rig.pool.stats()["driver_failures"]
        fb.arm(op, k)
        with pytest.raises(DriverError, match="INJECTED"):
            _act(rig, action)
        assert rig.state() == before, f"{op} failing at call {k} of {total} changed something"
        assert rig.pool.stats()["driver_failures"] == failures + 1  # and it was counted
        assert rig.account.driver_failures_total == failures + 1
        assert rig.ledger.snapshot().violations == ()
        fb.arm(None, None)
        _act(rig, action)  # the pool still works
        assert rig.ledger.snapshot().violations == ()
        rig.close()
        assert host.stats()["handles"] == 0 and host.physical_bytes() == 0


@pytest.mark.parametrize("op", OPS)
def test_background_map_failing_leaves_nothing_and_the_mapper_recovers(
    host: HostBackend, op: str
) -> None:
    fb, rig = _rig(host, min_spare_pages=2, max_spare_pages=3)
    before = rig.state()
    fb.arm(op, 2)  # a failure inside the first page id's map, on the mapper thread
    with BackgroundMapper(rig.pool, idle_seconds=0.01, error_backoff=0.01) as mapper:
        assert mapper.wait_idle()
        assert mapper.errors == 1
        assert rig.pool.stats()["spare_pages"] == 2
        state = rig.state()
    assert state != before
    assert host.physical_bytes() == rig.pool.stats()["physical_bytes"]
    assert rig.ledger.snapshot().total("physical_bytes") == host.physical_bytes()
    assert host.stats()["handles"] == rig.pool.stats()["live_handle_sets"] * LAYERS
    rig.close()
    assert host.physical_bytes() == 0 and host.stats()["handles"] == 0


def _every_layer_mapped(host: HostBackend, rig: Rig, page: int) -> list[bool]:
    return [host.is_mapped(rig.pool.store.pages.address(layer, page)) for layer in range(LAYERS)]


@pytest.mark.parametrize("background", [False, True])
def test_an_unmap_failing_at_any_layer_keeps_the_page_whole(
    host: HostBackend, background: bool
) -> None:
    """A page id is either mapped in every layer or in none: a trim whose unmap fails half way
    puts the layers it did back, so the pool never hands out a slot over an unmapped layer."""
    for k in range(LAYERS):
        fb, rig = _rig(host, max_spare_pages=0, handle_pool_pages=0)
        pool = rig.pool
        ids = pool.alloc(3 + SLOTS_PER_PAGE)  # page 0's rest and page 1
        fb.arm("unmap", k)
        if background:
            with BackgroundMapper(pool, idle_seconds=0.01, error_backoff=0.01) as mapper:
                pool.free(ids)
                assert mapper.wait_idle()
                assert mapper.errors == 1  # the first try failed, the retry unmapped it
            assert not pool.is_page_mapped(1)
            assert _every_layer_mapped(host, rig, 1) == [False] * LAYERS
        else:
            pool.store.policy.retry_after_s = 0.0  # the next free retries at once
            pool.free(ids)  # the unmap failure is counted, never raised out of free
            assert pool.stats()["driver_failures"] == 1
            assert rig.account.driver_failures_total == 1
            assert pool.occupied_ids() == []  # the free itself happened
            assert pool.is_page_mapped(1)
            assert _every_layer_mapped(host, rig, 1) == [True] * LAYERS, f"unmap failed at {k}"
            snap = rig.ledger.snapshot()
            assert snap.total("mapped_bytes") == 2 * LAYERS * SMALL_GRANULARITY
            assert snap.total("physical_bytes") == host.physical_bytes()
            fb.arm(None, None)
            again = pool.alloc(3 + SLOTS_PER_PAGE)  # the page is whole: its slots are usable
            for i in again.tolist():
                for layer in range(LAYERS):
                    pool.buffer(layer).view(-1)[pool.layout.slot_offset(i)] = 1
            pool.free(again)
            assert not pool.is_page_mapped(1)
        assert rig.ledger.snapshot().violations == ()
        assert host.physical_bytes() == rig.ledger.snapshot().total("physical_bytes")
        rig.close()
        assert host.physical_bytes() == 0 and host.stats()["mappings"] == 0
