"""NVML truth: the GPU is chosen by the CUDA device's UUID (or PCI bus id), never its ordinal;
the per-process figure is preferred to the device-wide one; outside-torch memory is named at a
re-baseline; and every failure degrades to "unavailable" with the reason, never a crash."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest

from accounting import nvml
from tests.ledgers import small_ledger


@dataclass
class Gpu:
    uuid: str
    pci: str
    used: list[int]
    processes: dict[int, list[int]] = field(default_factory=dict)  # pid -> used per read


class FakeNvml(types.SimpleNamespace):
    """Stands in for nvidia-ml-py's `pynvml`: GPUs in NVML's own order, each with a UUID, a
    PCI bus id, `used` per read and per-process `usedGpuMemory` per read. Looking a GPU up
    by index raises: the code under test must never do it."""

    def __init__(
        self, gpus: list[Gpu], *, fail_init: bool = False, hide_processes: bool = False
    ) -> None:
        super().__init__(nvmlMemory_v2=2)
        self.gpus = gpus
        self.fail_init = fail_init
        self.hide_processes = hide_processes

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Gpu:
        raise AssertionError(f"looked GPU {i} up by index: a CUDA ordinal is not an NVML index")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Gpu:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise RuntimeError("Not Found")

    def nvmlDeviceGetHandleByPciBusId_v2(self, pci: str) -> Gpu:
        for g in self.gpus:
            if g.pci.lower() == pci.lower():
                return g
        raise RuntimeError("Not Found")

    def nvmlDeviceGetUUID(self, handle: Gpu) -> str:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Gpu, version: int) -> types.SimpleNamespace:
        assert version == 2  # v2: `used` without the driver's reserved memory
        if not handle.used:
            raise RuntimeError("GPU is lost")
        return types.SimpleNamespace(
            used=handle.used.pop(0) if len(handle.used) > 1 else handle.used[0]
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Gpu) -> list:
        if self.hide_processes:
            raise RuntimeError("Insufficient Permissions")
        out = []
        for pid, seq in handle.processes.items():
            value = seq.pop(0) if len(seq) > 1 else seq[0]
            out.append(types.SimpleNamespace(pid=pid, usedGpuMemory=value))
        return out


UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
PCI0, PCI1 = "00000000:18:00.0", "00000000:3b:00.0"
PID = 4242


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    def install(module: FakeNvml, ids: dict[int, tuple[str | None, str | None]]) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", module)
        monkeypatch.setattr(nvml, "_initialised", False)
        monkeypatch.setattr(nvml, "cuda_device_ids", lambda device: ids[device])
        return module

    return install


def _vmm(snap) -> int:
    return sum(b.physical_bytes for b in snap.buffers if b.spec.owner.value == "vmm")


def test_the_cuda_device_is_found_by_uuid_not_by_its_ordinal(fake) -> None:
    # CUDA_VISIBLE_DEVICES=1: this process's cuda:0 is NVML's GPU 1.
    gpus = [Gpu(UUID0, PCI0, [10_000, 99_999]), Gpu(UUID1, PCI1, [500, 500 + 8192])]
    fake(FakeNvml(gpus, hide_processes=True), {0: (UUID1.removeprefix("GPU-"), None)})
    with small_ledger() as sl:
        read = nvml.nvml_truth(0, torch_reserved=lambda: 0)
        r = read(sl.ledger.snapshot(reconcile=False))
    assert r["available"] and r["detail"]["nvml_uuid"] == UUID1
    assert r["detail"]["baseline_used_bytes"] == 500 and r["device_bytes"] == 8192
    assert nvml.used_bytes(0) == 500 + 8192  # the module-level reader agrees


def test_the_pci_bus_id_when_the_device_reports_no_uuid(fake) -> None:
    gpus = [Gpu(UUID0, PCI0, [1]), Gpu(UUID1, PCI1, [7])]
    fake(FakeNvml(gpus), {0: (None, PCI1.upper())})
    assert nvml.used_bytes(0) == 7


def test_a_device_nvml_cannot_identify_is_unavailable_not_guessed(fake) -> None:
    fake(FakeNvml([Gpu(UUID0, PCI0, [1])]), {0: ("ffffffff-0000-0000-0000-000000000000", None)})
    with small_ledger() as sl:
        r = nvml.nvml_truth(0)(sl.ledger.snapshot(reconcile=False))
    assert r["available"] is False and r["basis"] == ""
    assert "NVML knows no GPU" in r["reason"] and "CUDA ordinal is not used" in r["reason"]


def test_the_per_process_figure_is_preferred_and_ignores_other_processes(fake) -> None:
    # Another process allocates 1 GiB on the shared GPU; ours grows by what the ledger holds.
    with small_ledger() as sl:
        sl.allocate(300)
        snap = sl.ledger.snapshot(reconcile=False)
        vmm = _vmm(snap)
        gpu = Gpu(UUID0, PCI0, [5_000, 5_000 + vmm + (1 << 30)], {PID: [900, 900 + vmm], 7: [1]})
        fake(FakeNvml([gpu]), {0: (UUID0, PCI0)})
        r = nvml.NvmlTruth(0, pid=PID)(snap)
    assert r["basis"] == "process" and r["detail"]["basis"] == "process"
    assert r["device_bytes"] == vmm and r["unattributed_bytes"] == 0
    assert r["detail"]["process_used_bytes"] == 900 + vmm
    assert r["detail"]["used_bytes"] == 5_000 + vmm + (1 << 30)


def test_device_wide_used_when_nvml_does_not_list_the_process(fake) -> None:
    with small_ledger() as sl:
        sl.allocate(300)
        snap = sl.ledger.snapshot(reconcile=False)
        vmm = _vmm(snap)
        gpu = Gpu(UUID0, PCI0, [1000, 1000 + vmm + 4096], {PID + 1: [5]})  # another pid only
        fake(FakeNvml([gpu]), {0: (UUID0, None)})
        r = nvml.NvmlTruth(0, pid=PID, torch_reserved=iter([0, 4096]).__next__)(snap)
    assert r["basis"] == "device" and r["device_bytes"] == vmm + 4096
    assert r["unattributed_bytes"] == 0 and r["detail"]["process_used_bytes"] is None


def test_torch_growth_is_attributed_and_split_into_kv_and_the_rest(fake) -> None:
    with small_ledger() as sl:
        snap = sl.ledger.snapshot(reconcile=False)
        runtime = sum(b.physical_bytes for b in snap.buffers if b.spec.owner.value == "runtime")
        assert runtime > 0
        vmm = _vmm(snap)
        reserved = iter([100 << 20, (100 << 20) + (6 << 20)])
        gpu = Gpu(UUID0, PCI0, [0], {PID: [2 << 30, (2 << 30) + (6 << 20) + vmm]})
        fake(FakeNvml([gpu]), {0: (UUID0, None)})
        r = nvml.NvmlTruth(0, pid=PID, torch_reserved=reserved.__next__)(snap)
    d = r["detail"]
    assert r["device_bytes"] == (6 << 20) + vmm and r["unattributed_bytes"] == 0
    assert d["torch_kv_bytes"] == runtime
    assert d["torch_non_kv_bytes"] == (106 << 20) - runtime


def test_rebaseline_names_outside_torch_memory_and_later_growth_shows(fake) -> None:
    # +72 MiB outside torch (a graph capture's executable graphs), named at the re-baseline;
    # +2 MiB after it (a kernel module loaded later) is unattributed.
    mib = 1 << 20
    with small_ledger() as sl:
        snap = sl.ledger.snapshot(reconcile=False)
        v = _vmm(snap)  # the ledger's VMM pages are explained throughout
        gpu = Gpu(UUID0, PCI0, [0], {PID: [100 * mib, 172 * mib + v, 172 * mib + v, 174 * mib + v]})
        fake(FakeNvml([gpu]), {0: (UUID0, None)})
        read = nvml.NvmlTruth(0, pid=PID, torch_reserved=lambda: 0)
        assert read.rebaseline(snap, "after capture") == 72 * mib
        r = read(snap)
        assert r["unattributed_bytes"] == 0 and r["detail"]["outside_torch_bytes"] == 72 * mib
        assert r["detail"]["rebaselined_at"] == "after capture"
        assert read(snap)["unattributed_bytes"] == 2 * mib


def test_no_nvml_library_is_unavailable_with_the_reason(fake) -> None:
    fake(FakeNvml([], fail_init=True), {0: (UUID0, None)})
    with small_ledger() as sl:
        r = nvml.nvml_truth(0)(sl.ledger.snapshot(reconcile=False))
    assert r["available"] is False and r["device_bytes"] is None and r["unattributed_bytes"] is None
    assert "NVML unavailable" in r["reason"] and "Shared Library Not Found" in r["reason"]
    assert nvml.process_used_bytes(0) is None


def test_a_failing_read_is_unavailable_and_the_next_can_recover(fake) -> None:
    gpu = Gpu(UUID0, PCI0, [500])
    fake(FakeNvml([gpu], hide_processes=True), {0: (UUID0, None)})
    read = nvml.nvml_truth(0)
    gpu.used.clear()
    with small_ledger() as sl:
        snap = sl.ledger.snapshot(reconcile=False)
        r = read(snap)
        assert r["available"] is False and "NVML read failed" in r["reason"]
        assert "GPU is lost" in r["reason"]
        gpu.used.append(500)
        assert read(snap)["available"] is True


def test_through_the_ledger_a_missing_nvml_never_breaks_a_snapshot(fake) -> None:
    fake(FakeNvml([], fail_init=True), {0: (UUID0, None)})
    with small_ledger() as sl:
        sl.ledger.add_truth(nvml.nvml_truth(0))
        snap = sl.ledger.snapshot()
    assert [r["source"] for r in snap.reconciliation][-1] == "nvml"
    assert snap.reconciliation[-1]["available"] is False
