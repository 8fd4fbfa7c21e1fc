"""NVML truth degrades to "unavailable" with the reason, never a crash: no NVML library, no
device, a failing read, or a sandbox that hides processes."""

from __future__ import annotations

import sys
import types

import pytest

from accounting import nvml
from tests.ledgers import small_ledger


class FakeNvml(types.SimpleNamespace):
    """Stands in for the `pynvml` module of nvidia-ml-py: used memory per call from a list."""

    def __init__(
        self, used: list[int], *, fail_init: bool = False, hide_processes: bool = False
    ) -> None:
        super().__init__(nvmlMemory_v2=2)
        self.used = list(used)
        self.fail_init = fail_init
        self.hide_processes = hide_processes

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int) -> types.SimpleNamespace:
        assert version == 2  # v2: `used` without the driver's reserved memory
        if not self.used:
            raise RuntimeError("GPU is lost")
        return types.SimpleNamespace(used=self.used.pop(0))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        if self.hide_processes:
            raise RuntimeError("Insufficient Permissions")
        return []


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    def install(module: FakeNvml) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", module)
        monkeypatch.setattr(nvml, "_initialised", False)
        return module

    return install


def test_used_delta_against_vmm_and_torch_bytes(fake) -> None:
    with small_ledger() as sl:
        sl.allocate(300)
        snap = sl.ledger.snapshot(reconcile=False)
        vmm = sum(b.physical_bytes for b in snap.buffers if b.spec.owner.value == "vmm")
        fake(FakeNvml([1000, 1000 + vmm + 4096], hide_processes=True))
        read = nvml.nvml_truth(0, torch_reserved=lambda: 4096)
        r = read(snap)
        assert r["available"] and r["device_bytes"] == vmm + 4096 and r["unattributed_bytes"] == 0
        assert r["detail"]["process_used_bytes"] is None  # hidden processes: unknown, not a crash


def test_no_nvml_library_is_unavailable_with_the_reason(fake) -> None:
    fake(FakeNvml([], fail_init=True))
    with small_ledger() as sl:
        r = nvml.nvml_truth(0)(sl.ledger.snapshot(reconcile=False))
    assert r["available"] is False and r["device_bytes"] is None and r["unattributed_bytes"] is None
    assert "NVML unavailable" in r["reason"] and "Shared Library Not Found" in r["reason"]


def test_a_failing_read_is_unavailable_and_the_next_can_recover(fake) -> None:
    mod = fake(FakeNvml([500]))  # baseline read, then nothing: the read fails
    read = nvml.nvml_truth(0)
    with small_ledger() as sl:
        snap = sl.ledger.snapshot(reconcile=False)
        r = read(snap)
        assert (
            r["available"] is False
            and "NVML read failed" in r["reason"]
            and "GPU is lost" in r["reason"]
        )
        mod.used.append(500)
        assert read(snap)["available"] is True


def test_through_the_ledger_a_missing_nvml_never_breaks_a_snapshot(fake) -> None:
    fake(FakeNvml([], fail_init=True))
    with small_ledger() as sl:
        sl.ledger.add_truth(nvml.nvml_truth(0))
        snap = sl.ledger.snapshot()
    assert [r["source"] for r in snap.reconciliation][-1] == "nvml"
    assert snap.reconciliation[-1]["available"] is False
