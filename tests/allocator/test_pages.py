"""LayerSet: one page id across every layer, each operation all or nothing."""

from __future__ import annotations

from typing import Any

import pytest

from allocator.errors import DriverError
from allocator.host import HostBackend
from allocator.pages import LayerSet
from tests.allocator.rigs import FailingBackend


def _layers(be: Any, layers: int = 4, pages: int = 3) -> LayerSet:
    return LayerSet(
        be, layers=layers, reserved_bytes=pages * be.granularity, page_bytes=be.granularity
    )


def test_one_reservation_per_layer_and_addresses(host: HostBackend) -> None:
    ls = _layers(host)
    g = host.granularity
    assert len(ls.bases) == 4 and len(set(ls.bases)) == 4
    assert ls.address(2, 1) == ls.bases[2] + g
    assert host.stats()["reservations"] == 4
    ls.free_reservations()
    ls.free_reservations()  # idempotent
    assert host.stats()["reservations"] == 0


def test_bad_arguments_are_refused(host: HostBackend) -> None:
    g = host.granularity
    with pytest.raises(ValueError, match="layers=0"):
        LayerSet(host, layers=0, reserved_bytes=g, page_bytes=g)
    with pytest.raises(ValueError, match="page_bytes"):
        LayerSet(host, layers=1, reserved_bytes=g, page_bytes=g // 2)
    with pytest.raises(ValueError, match="reserved_bytes"):
        LayerSet(host, layers=1, reserved_bytes=3 * g, page_bytes=2 * g)
    assert host.stats()["reservations"] == 0


def test_a_reservation_failing_half_way_frees_the_others(host: HostBackend) -> None:
    fb = FailingBackend(host, "reserve", 2)
    with pytest.raises(DriverError, match="INJECTED"):
        _layers(fb)
    assert host.stats()["reservations"] == 0


def test_map_page_maps_every_layer_and_unmap_page_undoes_it(host: HostBackend) -> None:
    ls = _layers(host)
    g = host.granularity
    handles = ls.create_set()
    assert host.physical_bytes() == 4 * g
    ls.map_page(1, handles)
    for layer in range(4):
        t = host.byte_tensor(ls.address(layer, 1), g)
        t.fill_(layer + 1)
    assert host.stats()["mappings"] == 4
    ls.unmap_page(1)
    assert host.stats()["mappings"] == 0
    ls.release_set(handles)
    assert host.physical_bytes() == 0
    ls.free_reservations()


def test_map_page_wants_one_handle_per_layer(host: HostBackend) -> None:
    ls = _layers(host, layers=2)
    with pytest.raises(ValueError, match="3 handles"):
        ls.map_page(0, [1, 2, 3])
    ls.free_reservations()


@pytest.mark.parametrize("op", ["map", "set_access"])
def test_map_page_failing_at_any_layer_undoes_the_layers_it_did(host: HostBackend, op: str) -> None:
    layers = 4
    for k in range(layers):
        fb = FailingBackend(host)
        ls = _layers(fb, layers=layers)
        handles = ls.create_set()
        before = host.debug_state()
        fb.arm(op, k)
        with pytest.raises(DriverError, match="INJECTED"):
            ls.map_page(0, handles)
        assert host.debug_state() == before, f"{op} failing at layer {k} left something"
        fb.arm(None, None)
        ls.map_page(0, handles)  # the same handles still map
        ls.unmap_page(0)
        ls.release_set(handles)
        ls.free_reservations()
    assert host.stats()["handles"] == 0 and host.physical_bytes() == 0


def test_create_set_failing_half_way_releases_what_it_created(host: HostBackend) -> None:
    for k in range(3):
        fb = FailingBackend(host, "create", k)
        ls = _layers(fb, layers=3)
        with pytest.raises(DriverError, match="INJECTED"):
            ls.create_set()
        assert host.stats()["handles"] == 0 and host.physical_bytes() == 0
        ls.free_reservations()


def test_release_set_tries_every_handle_and_raises_the_first_error(host: HostBackend) -> None:
    fb = FailingBackend(host)
    ls = _layers(fb, layers=3)
    handles = ls.create_set()
    fb.arm("release", 0)
    with pytest.raises(DriverError, match="INJECTED"):
        ls.release_set(handles)
    assert host.stats()["handles"] == 1  # only the failed one is left
    host.release(handles[0])
    ls.free_reservations()
