"""Device truth from NVML (nvidia-ml-py). The only module that imports `pynvml`.

Which GPU: the one the process's CUDA device really is. A CUDA ordinal names another
GPU as soon as `CUDA_VISIBLE_DEVICES` or `CUDA_DEVICE_ORDER` remaps devices (NVML
numbers every GPU of the host, in PCI order), so the NVML handle is looked up by the
CUDA device's UUID (`torch.cuda.get_device_properties(i).uuid`), else by its PCI bus id,
and never by the ordinal.

Which figure (the reader's `basis`):

- `process`: NVML's per-process used memory (`nvmlDeviceGetComputeRunningProcesses`,
  the entry with this pid). Not moved by other processes on a shared GPU. It leaves
  out memory the driver allocates with the context but does not attribute to the
  process (on an H200 a constant 9,240,576 B below the device-wide delta), which the
  deltas below cancel.
- `device`: NVML's device-wide `used` (v2 struct, equal to `torch.cuda.mem_get_info`;
  v1 also counts the driver's reserved memory, about 615 MiB on an H200). Used where
  NVML does not list this process (a container's pid namespace, a sandbox).

The reader compares the growth since its baseline (taken when it is built) with what
the ledger and torch explain:

    device_bytes  = figure_now - figure_at_baseline
    ledger_bytes  = growth of VMM physical bytes since the baseline (live handles,
                      mapped or kept; `vmm_at_baseline` what was mapped when it was built)
                    + growth of torch's physical bytes since the baseline (reserved, less
                      the virtual extent of VMM arenas: `accounting.torch_memory`)
                      (runtime-owned KV buffers and everything else torch's caching
                      allocator holds: weights, activations, CUDA graph pools)
                    + outside-torch bytes frozen at the last re-baseline point
    unattributed  = device_bytes - ledger_bytes

Memory the process takes outside torch and the VMM pools -- kernel modules (a
Triton kernel's first launch loads its module: about 2 MiB), the executable graphs
and workspaces a CUDA graph capture instantiates (about 72 MiB seen in an SGLang
process) -- is unattributed until `rebaseline()` names it: the growth outside torch at
that point is frozen as `outside_torch_bytes` and explained from then on. The SGLang
plugin re-baselines after CUDA graph capture. `detail` also splits torch's reserved
bytes into the KV storage it holds (`torch_kv_bytes`, the ledger's runtime-owned
physical bytes) and the rest (`torch_non_kv_bytes`).

With torch's pools and the model's weights given (`torch_memory`, `weights`), every
result also splits the device's used memory into the parts of `accounting.gpu_parts`
(`parts`), and carries the GPU's NVML UUID and index (`uuid`, `gpu`: dcgm-exporter's
labels) and size (`total_bytes`). Why NVML's per-process figure is not used, when it
is not, is `detail["process_figure"]`.

Missing NVML, no device, or a device NVML cannot identify degrade to
`available: False` with the reason; nothing raises. A GPU that stops answering (NVML
raises `NVMLError_GpuIsLost`, ...) is one warning in the log, then `available: False`
at every read until it answers again (one more line says so).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from accounting.buffers import Owner
from accounting.gpu_parts import Baseline, Readings, TorchMemory, parts_of
from accounting.reconcile import result, vmm_physical_bytes

log = logging.getLogger(__name__)

_init_lock = threading.Lock()
_initialised = False


def _nvml() -> Any:
    global _initialised
    import pynvml  # from the nvidia-ml-py distribution

    with _init_lock:
        if not _initialised:
            pynvml.nvmlInit()
            _initialised = True
    return pynvml


def cuda_device_ids(device: int) -> tuple[str | None, str | None]:
    """(UUID, PCI bus id) of CUDA device `device` as this process numbers it (torch)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    parts = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    pci = None
    if all(isinstance(p, int) for p in parts):
        pci = f"{parts[0]:08x}:{parts[1]:02x}:{parts[2]:02x}.0"
    return (str(uuid) if uuid is not None else None), pci


def device_handle(device: int) -> Any:
    """NVML's handle of CUDA device `device`, found by UUID, else by PCI bus id."""
    nv = _nvml()
    uuid, pci = cuda_device_ids(device)
    errors = []
    if uuid:
        names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
        for name in names:
            try:
                return nv.nvmlDeviceGetHandleByUUID(name)
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
    if pci:
        try:
            return nv.nvmlDeviceGetHandleByPciBusId_v2(pci)
        except Exception as e:
            errors.append(f"pci {pci}: {type(e).__name__}: {e}")
    raise LookupError(
        f"CUDA device {device}: NVML knows no GPU with its UUID or PCI bus id "
        f"({'; '.join(errors) or 'the device reports neither'}); the CUDA ordinal is not used"
    )


def device_identity(handle: Any) -> str:
    try:
        value = _nvml().nvmlDeviceGetUUID(handle)
    except Exception:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def device_index(handle: Any) -> str:
    """NVML's index of the GPU (dcgm-exporter's `gpu` label), "" when NVML does not say."""
    try:
        return str(int(_nvml().nvmlDeviceGetIndex(handle)))
    except Exception:
        return ""


def _total(handle: Any) -> int:
    nv = _nvml()
    return int(nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2).total)


def used_bytes(device: int) -> int:
    """NVML v2 `used` bytes of CUDA device `device`. Raises when NVML is missing or fails."""
    return _used(device_handle(device))


def _used(handle: Any) -> int:
    nv = _nvml()
    return int(nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2).used)


def process_used_bytes(device: int, pid: int | None = None) -> int | None:
    """Memory NVML attributes to `pid` on CUDA device `device`; None where NVML cannot see it."""
    try:
        return _process_used(device_handle(device), os.getpid() if pid is None else pid)
    except Exception:
        return None


def _process_used(handle: Any, pid: int) -> int | None:
    try:
        procs = _nvml().nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return None
    mine = [int(p.usedGpuMemory) for p in procs if p.pid == pid and p.usedGpuMemory is not None]
    return sum(mine) if mine else None


def runtime_physical_bytes(snapshot: Any) -> int:
    """Physical bytes of the snapshot's runtime-owned buffers: the KV storage torch's caching
    allocator holds (a rank's ledger holds the pools of its one device)."""
    return sum(b.physical_bytes for b in snapshot.buffers if b.spec.owner is Owner.RUNTIME)


class NvmlTruth:
    """Truth reader for CUDA (`Ledger.add_truth`). Takes its baseline when built: build it
    before the memory it should explain, or `rebaseline()` once that memory is named.

    With `torch_memory` (torch's caching allocator split by pool, `accounting.torch_memory`)
    and `weights` (the model's parameter and buffer bytes), each result also carries the
    GPU parts (`accounting.gpu_parts`): `parts`, the GPU's `uuid` and NVML `gpu` index.
    `torch_reserved` alone (the older form) gives the reconciliation without a split of
    torch's bytes."""

    def __init__(
        self,
        device: int = 0,
        *,
        torch_reserved: Callable[[], int] | None = None,
        torch_memory: Callable[[], TorchMemory] | None = None,
        weights: Callable[[], int] | None = None,
        pid: int | None = None,
        vmm_at_baseline: int = 0,
    ) -> None:
        self.device = device
        self._base_vmm = vmm_at_baseline  # VMM pages already mapped when it is built
        self.pid = os.getpid() if pid is None else pid
        self._torch_reserved = torch_reserved
        self._torch_memory = torch_memory
        self._weights = weights
        self.outside_torch_bytes = 0
        self.rebaselined_at = ""
        self.basis = ""
        self.reason = ""
        self.process_reason = ""  # why NVML's per-process figure is not read, or ""
        self._handle: Any = None
        self.identity = ""
        self.index = ""
        self._lost = ""  # the failure last logged, so a lost GPU is one log line
        try:
            self._handle = device_handle(device)
            self.identity = device_identity(self._handle)
            self.index = device_index(self._handle)
            self._base_used: int | None = _used(self._handle)
            self._base_process = self._process(self.pid)
            self.basis = "process" if self._base_process is not None else "device"
        except Exception as e:
            self._base_used, self._base_process = None, None
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
        self._base_torch = self._torch_now().physical_bytes

    def _torch_now(self) -> TorchMemory:
        if self._torch_memory is not None:
            return self._torch_memory()
        reserved = int(self._torch_reserved()) if self._torch_reserved is not None else 0
        return TorchMemory(reserved_bytes=reserved, allocated_bytes=reserved)

    def _process(self, pid: int) -> int | None:
        try:
            procs = _nvml().nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception as e:
            self.process_reason = (
                f"NVML's per-process figure unreadable ({type(e).__name__}: {e}); "
                "device-wide figures used"
            )
            return None
        mine = [int(p.usedGpuMemory) for p in procs if p.pid == pid and p.usedGpuMemory is not None]
        if not mine:
            self.process_reason = (
                f"NVML lists no process with pid {pid} on this GPU (another pid namespace, "
                "MIG, or no permission); device-wide figures used"
            )
            return None
        self.process_reason = ""
        return sum(mine)

    def _figures(self) -> tuple[str, int, int, int | None]:
        """(basis, growth since the baseline, device used, process used)."""
        used = _used(self._handle)
        process = self._process(self.pid) if self._base_process is not None else None
        if process is not None and self._base_process is not None:
            return "process", process - self._base_process, used, process
        assert self._base_used is not None
        return "device", used - self._base_used, used, process

    def rebaseline(self, snapshot: Any, point: str) -> int | None:
        """Freeze the growth outside torch and the VMM pools so far as `outside_torch_bytes`
        (explained from now on), naming the point; returns it, or None when unavailable."""
        if self._base_used is None:
            return None
        try:
            _, grown, _, _ = self._figures()
        except Exception as e:
            self._lost_once(e)
            return None
        torch_grown = self._torch_now().physical_bytes - self._base_torch
        vmm_grown = vmm_physical_bytes(snapshot) - self._base_vmm
        self.outside_torch_bytes = grown - vmm_grown - torch_grown
        self.rebaselined_at = point
        return self.outside_torch_bytes

    def _lost_once(self, e: Exception) -> str:
        reason = f"NVML read failed: {type(e).__name__}: {e}"
        if reason != self._lost:
            log.warning("kvledger: GPU %s (cuda:%s): %s", self.identity, self.device, reason)
            self._lost = reason
        return reason

    def __call__(self, snapshot: Any) -> dict[str, Any]:
        vmm = vmm_physical_bytes(snapshot)
        torch_now = self._torch_now()
        ledger = (
            vmm
            - self._base_vmm
            + (torch_now.physical_bytes - self._base_torch)
            + self.outside_torch_bytes
        )
        uuid, gpu = self.identity, self.index
        if self._base_used is None:
            return result(
                "nvml",
                ledger_bytes=ledger,
                device_bytes=None,
                reason=self.reason,
                uuid=uuid,
                gpu=gpu,
            )
        try:
            basis, grown, used, process = self._figures()
        except Exception as e:
            return result(
                "nvml",
                ledger_bytes=ledger,
                device_bytes=None,
                reason=self._lost_once(e),
                uuid=uuid,
                gpu=gpu,
            )
        if self._lost:
            log.warning("kvledger: GPU %s (cuda:%s) readable again", self.identity, self.device)
            self._lost = ""
        torch_kv = runtime_physical_bytes(snapshot)
        detail = {
            "device": self.device,
            "nvml_uuid": self.identity,
            "basis": basis,
            "process_figure": self.process_reason or "read",
            "used_bytes": used,
            "baseline_used_bytes": self._base_used,
            "process_used_bytes": process,
            "baseline_process_used_bytes": self._base_process,
            "vmm_physical_bytes": vmm,
            "torch_reserved_bytes": torch_now.reserved_bytes,
            "baseline_torch_reserved_bytes": self._base_torch,
            "torch_kv_bytes": torch_kv,
            "torch_non_kv_bytes": torch_now.physical_bytes - torch_kv,
            "outside_torch_bytes": self.outside_torch_bytes,
            "rebaselined_at": self.rebaselined_at,
        }
        parts: dict[str, int] = {}
        if self._torch_memory is not None:
            readings = Readings(
                device_used=used,
                process_used=process if basis == "process" else None,
                torch=torch_now,
                weights_bytes=int(self._weights()) if self._weights is not None else 0,
                kv_bytes=snapshot.total("physical_bytes"),
                kv_torch_bytes=torch_kv,
                vmm_bytes=vmm,
                baseline=Baseline(
                    device_used=self._base_used,
                    process_used=self._base_process if basis == "process" else None,
                    torch_physical=self._base_torch,
                    vmm_bytes=self._base_vmm,
                    named_outside_bytes=self.outside_torch_bytes,
                ),
            )
            parts = parts_of(readings)
        try:
            total: int | None = _total(self._handle)
        except Exception:
            total = None
        return result(
            "nvml",
            ledger_bytes=ledger,
            device_bytes=grown,
            basis=basis,
            detail=detail,
            parts=parts,
            total_bytes=total,
            uuid=uuid,
            gpu=gpu,
        )


def nvml_truth(
    device: int = 0,
    *,
    torch_reserved: Callable[[], int] | None = None,
    torch_memory: Callable[[], TorchMemory] | None = None,
    weights: Callable[[], int] | None = None,
) -> NvmlTruth:
    """Truth reader for CUDA device `device` (this process's ordinal). Takes the baseline now:
    build it before the pools."""
    return NvmlTruth(
        device, torch_reserved=torch_reserved, torch_memory=torch_memory, weights=weights
    )
