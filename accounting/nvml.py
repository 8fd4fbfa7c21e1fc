"""Device truth from NVML (nvidia-ml-py). The only module that imports `pynvml`.

NVML's v2 memory struct reports `used` equal to `torch.cuda.mem_get_info`; v1's
`used` also counts the driver's reserved memory (about 615 MiB on an H200), so
v2 is asked for. The reader compares the growth of `used` since a baseline taken
before the pools were built with what the ledger holds:

    device_bytes  = used_now - used_at_baseline
    ledger_bytes  = VMM physical bytes (live handles, mapped or kept)
                    + torch's reserved bytes (where runtime-owned buffers live)
    unattributed  = device_bytes - ledger_bytes

Anything else the process allocated outside torch and the VMM pools shows up as
unattributed. Missing NVML, no device, or a sandbox that hides processes
degrade to `available: False` with the reason; nothing raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from accounting.reconcile import result, vmm_physical_bytes

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


def used_bytes(device: int) -> int:
    """NVML v2 `used` bytes of one device. Raises when NVML is missing or fails."""
    nv = _nvml()
    handle = nv.nvmlDeviceGetHandleByIndex(device)
    return int(nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2).used)


def process_used_bytes(device: int, pid: int | None = None) -> int | None:
    """Memory NVML attributes to `pid` on `device`; None where NVML cannot see processes."""
    try:
        nv = _nvml()
        handle = nv.nvmlDeviceGetHandleByIndex(device)
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return None
    pid = os.getpid() if pid is None else pid
    for p in procs:
        if p.pid == pid and p.usedGpuMemory is not None:
            return int(p.usedGpuMemory)
    return None


def nvml_truth(
    device: int = 0, *, torch_reserved: Callable[[], int] | None = None
) -> Callable[[Any], dict[str, Any]]:
    """Truth reader for CUDA. Takes the baseline now: build it before the pools."""
    try:
        baseline: int | None = used_bytes(device)
        why = ""
    except Exception as e:
        baseline, why = None, f"NVML unavailable: {type(e).__name__}: {e}"

    def read(snapshot: Any) -> dict[str, Any]:
        vmm = vmm_physical_bytes(snapshot)
        torch_bytes = int(torch_reserved()) if torch_reserved is not None else 0
        ledger = vmm + torch_bytes
        if baseline is None:
            return result("nvml", ledger_bytes=ledger, device_bytes=None, reason=why)
        try:
            used = used_bytes(device)
        except Exception as e:
            return result(
                "nvml",
                ledger_bytes=ledger,
                device_bytes=None,
                reason=f"NVML read failed: {type(e).__name__}: {e}",
            )
        detail = {
            "device": device,
            "used_bytes": used,
            "baseline_used_bytes": baseline,
            "vmm_physical_bytes": vmm,
            "torch_reserved_bytes": torch_bytes,
            "process_used_bytes": process_used_bytes(device),
        }
        return result("nvml", ledger_bytes=ledger, device_bytes=used - baseline, detail=detail)

    return read
