"""Fixtures of the allocator tests: every backend for the contract suite, a host backend
with a small granularity, and pool rigs (pool + ledger) closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from allocator.host import HostBackend
from allocator.slots.layout import SlotLayout
from tests.allocator.rigs import KIB, SMALL_GRANULARITY, Rig, make_backend


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Every backend the contract suite runs against; CUDA only where a GPU is present."""
    be = make_backend(request.param)
    try:
        yield be
    finally:
        be.close()


@pytest.fixture
def host() -> Iterator[HostBackend]:
    be = HostBackend(SMALL_GRANULARITY)
    try:
        yield be
    finally:
        be.close()


@pytest.fixture
def rig_factory(host: HostBackend) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(*, layers: int = 3, layout: SlotLayout | None = None, **options: Any) -> Rig:
        layout = layout or SlotLayout(
            capacity_slots=64, slot_bytes=16 * KIB, page_bytes=SMALL_GRANULARITY
        )
        r = Rig(host, layers=layers, layout=layout, **options)
        rigs.append(r)
        return r

    try:
        yield make
    finally:
        for r in rigs:
            r.close()
