"""A stand-in for nvidia-ml-py's `pynvml` at accounting.nvml's boundary: one GPU whose
device-wide and per-process figures are read live from callables, and failures raised as
pynvml's own error classes (`NVMLError_GpuIsLost`, `NVMLError_NoPermission`, ...), so the
code under test sees what it would see from the real library."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pynvml

UUID = "GPU-5e1f0c2a-0000-4000-8000-00000000cafe"
INDEX = 3


class NvmlStandIn(types.SimpleNamespace):
    def __init__(
        self,
        *,
        pid: int,
        process_used: Callable[[], int],
        others: Callable[[], dict[int, int]] = dict,
        unlisted: int = 0,
        total: int = 141 << 30,
    ) -> None:
        super().__init__(nvmlMemory_v2=pynvml.nvmlMemory_v2)
        self.pid = pid
        self.process_used = process_used
        self.others = others
        self.unlisted = unlisted  # driver memory NVML charges to no process
        self.total = total
        self.lost: BaseException | None = None  # raised by every read once set
        self.processes_error: BaseException | None = None  # raised by the process list
        self.hide_pid = False  # the process list leaves this pid out (a pid namespace)

    # the names of nvidia-ml-py that accounting.nvml calls
    def nvmlInit(self) -> None:
        pass

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != UUID:
            raise pynvml.NVMLError_NotFound()
        return uuid

    def nvmlDeviceGetHandleByPciBusId_v2(self, pci: str) -> str:
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle

    def nvmlDeviceGetIndex(self, handle: str) -> int:
        return INDEX

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: Any = None) -> Any:
        assert version == pynvml.nvmlMemory_v2
        self._check()
        used = self.process_used() + sum(self.others().values()) + self.unlisted
        return types.SimpleNamespace(used=used, total=self.total, free=self.total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        self._check()
        if self.processes_error is not None:
            raise self.processes_error
        rows = dict(self.others())
        if not self.hide_pid:
            rows[self.pid] = self.process_used()
        return [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in rows.items()]


def install(monkeypatch: Any, standin: NvmlStandIn) -> NvmlStandIn:
    """Put `standin` where accounting.nvml imports pynvml, and name this process's CUDA
    device by the stand-in GPU's UUID (no CUDA here)."""
    from accounting import nvml

    monkeypatch.setitem(sys.modules, "pynvml", standin)
    monkeypatch.setattr(nvml, "_initialised", False)
    monkeypatch.setattr(nvml, "cuda_device_ids", lambda device: (UUID.removeprefix("GPU-"), None))
    return standin
