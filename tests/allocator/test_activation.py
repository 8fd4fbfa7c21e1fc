"""Opt-in activation: off by default, falls back to ordinary tensors with the reason, or refuses
with `require`; nothing is left held on either path."""

from __future__ import annotations

import logging

import pytest

from allocator import HostBackend, IncompatibleError, SlotLayout
from allocator.activation import (
    Activation,
    NativeSwaBuffers,
    VmmSwaBuffers,
    build_swa_buffers,
)
from allocator.errors import DriverError

G = 64 << 10
LAYOUT = SlotLayout(
    capacity_slots=1024, slot_bytes=584, page_bytes=G, slots_per_row=256, row_bytes=149_760
)


class Factory:
    """Makes host backends and remembers them, so a test can check they were closed."""

    def __init__(self, fail: bool = False) -> None:
        self.made: list[HostBackend] = []
        self.fail = fail

    def __call__(self) -> HostBackend:
        if self.fail:
            raise DriverError(
                "cuInit", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"
            )
        be = HostBackend(G)
        self.made.append(be)
        return be


def test_env_flags() -> None:
    assert Activation.from_env({}) == Activation(False, False)
    assert Activation.from_env({"KVLEDGER_VMM": "1", "KVLEDGER_VMM_REQUIRE": "yes"}) == Activation(
        True, True
    )
    with pytest.raises(ValueError, match=r"KVLEDGER_VMM='maybe', expected one of"):
        Activation.from_env({"KVLEDGER_VMM": "maybe"})


def test_off_by_default_gives_ordinary_tensors_and_makes_no_backend() -> None:
    factory = Factory()
    bufs = build_swa_buffers(layers=3, layout=LAYOUT, backend=factory, activation=Activation())
    assert isinstance(bufs, NativeSwaBuffers) and bufs.pool is None
    assert "KVLEDGER_VMM=1" in bufs.reason
    assert [t.numel() for t in bufs.tensors] == [LAYOUT.buffer_bytes] * 3
    assert factory.made == []
    bufs.close()
    assert bufs.tensors == []


def test_on_and_compatible_puts_the_buffers_on_the_vmm_pool_and_close_releases_all() -> None:
    factory = Factory()
    bufs = build_swa_buffers(
        layers=3, layout=LAYOUT, backend=factory, activation=Activation(enabled=True)
    )
    assert isinstance(bufs, VmmSwaBuffers)
    (be,) = factory.made
    ids = bufs.pool.alloc(300)
    assert be.physical_bytes() > 0 and len(bufs.tensors) == 3
    bufs.pool.free(ids)
    bufs.close()
    assert be.closed and bufs.pool.closed


@pytest.mark.parametrize("require", [False, True])
def test_incompatible_shape_falls_back_with_the_reason_or_refuses(
    require: bool, caplog: pytest.LogCaptureFixture
) -> None:
    factory = Factory()
    act = Activation(enabled=True, require=require)
    # 149760-byte rows are not a whole number of 7-byte elements
    if require:
        with pytest.raises(
            IncompatibleError, match=r"row_bytes=149760 is not a whole number of 7-byte elements"
        ):
            build_swa_buffers(
                layers=2, layout=LAYOUT, backend=factory, activation=act, element_size=7
            )
    else:
        with caplog.at_level(logging.WARNING, logger="allocator.activation"):
            bufs = build_swa_buffers(
                layers=2, layout=LAYOUT, backend=factory, activation=act, element_size=7
            )
        assert isinstance(bufs, NativeSwaBuffers) and "7-byte elements" in bufs.reason
        assert "keeping ordinary tensors" in caplog.text
    assert all(be.closed for be in factory.made)  # the backend made for the check is not leaked


@pytest.mark.parametrize("require", [False, True])
def test_no_backend_falls_back_or_refuses(require: bool) -> None:
    act = Activation(enabled=True, require=require)
    if require:
        with pytest.raises(IncompatibleError, match="CUDA_ERROR_NO_DEVICE"):
            build_swa_buffers(layers=2, layout=LAYOUT, backend=Factory(fail=True), activation=act)
    else:
        bufs = build_swa_buffers(
            layers=2, layout=LAYOUT, backend=Factory(fail=True), activation=act
        )
        assert isinstance(bufs, NativeSwaBuffers) and "CUDA_ERROR_NO_DEVICE" in bufs.reason
