"""kvledger.tools.bench.driver_floor over a stand-in driver: what it calls, and that it gives back
everything it made (the run on a GPU is scripts/gpu-check's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvledger.tools.bench.driver_floor import driver_floor_seconds


class FakeDriver:
    """cuda.bindings.driver's VMM calls as result tuples (0: success), with the books kept."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reserved: set[int] = set()
        self.handles: set[int] = set()
        self.mapped: set[int] = set()
        self._next = 1 << 20

    def _new(self) -> int:
        self._next += 1 << 20
        return self._next

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> Any:
        base = self._new()
        self.reserved.add(base)
        return (0, base)

    def cuMemAddressFree(self, base: int, size: int) -> Any:
        self.reserved.remove(base)
        return (0,)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        self.calls.append("create")
        h = self._new()
        self.handles.add(h)
        return (0, h)

    def cuMemRelease(self, h: int) -> Any:
        self.handles.remove(h)
        return (0,)

    def cuMemMap(self, addr: int, size: int, offset: int, h: int, flags: int) -> Any:
        self.calls.append("map")
        self.mapped.add(addr)
        return (0,)

    def cuMemSetAccess(self, addr: int, size: int, access: Any, count: int) -> Any:
        self.calls.append("set_access")
        return (0,)

    def cuMemUnmap(self, addr: int, size: int) -> Any:
        self.mapped.remove(addr)
        return (0,)


def _check(result: Any, op: str, address: int | None = None) -> Any:
    err, *values = result
    if err:
        raise RuntimeError(f"{op} failed")
    return values[0] if values else None


class FakeBackend:
    def __init__(self) -> None:
        self.driver = FakeDriver()

    def driver_calls(self) -> Any:
        return SimpleNamespace(
            driver=self.driver, prop=object(), access=[object()], granularity=4096, check=_check
        )


@pytest.mark.parametrize("naive", [False, True])
def test_each_timed_map_is_one_page_id_and_everything_is_given_back(naive: bool) -> None:
    be = FakeBackend()
    out = driver_floor_seconds(be, layers=3, page_bytes=4096, repeats=4, naive=naive)
    assert len(out) == 4 and all(s >= 0 for s in out)
    drv = be.driver
    creates = drv.calls.count("create")
    assert creates == (3 * 4 if naive else 3)  # naive creates per map; pooled once
    assert drv.calls.count("map") == drv.calls.count("set_access") == 3 * 4
    assert drv.reserved == set() and drv.handles == set() and drv.mapped == set()
