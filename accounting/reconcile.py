"""Reconciliation: the ledger's physical figures held against device truth.

A truth reader is a callable `(snapshot) -> dict` registered with
`Ledger.add_truth`; it is read once per snapshot. Every reader returns the same
keys, so the exporter and the debug endpoint treat them alike:

    source              "host_memfd", "nvml", ...
    basis               which figure of that truth was read: "memfd" (allocated blocks),
                        "process" (NVML's per-process used memory), "device" (NVML's
                        device-wide used memory); "" when unavailable
    available           False when the truth could not be read; `reason` says why
    reason              "" or why the truth is unavailable
    device_bytes        what the truth says is held (None when unavailable)
    ledger_bytes        the ledger figure it is held against
    unattributed_bytes  device_bytes - ledger_bytes (None when unavailable)
    detail              source-specific figures (dict)
    parts               the GPU parts (accounting.gpu_parts: name -> bytes), {} when the
                        reader does not split the device
    uuid, gpu           the GPU's NVML UUID and index (dcgm-exporter's `UUID` and `gpu`
                        labels); "" for a truth that is not a GPU
    total_bytes         the device's memory size (NVML total), None when not known

Host backend: the memfd's allocated blocks against the VMM physical total; exact
to the page when no allocator call is in flight, and always when the reader has the page
store's `quiescent` to hold (`HostMemfdTruth`). CUDA: see accounting.nvml.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accounting.buffers import Owner


def vmm_physical_bytes(snapshot: Any) -> int:
    """Physical bytes of the snapshot's VMM-owned buffers."""
    return sum(b.physical_bytes for b in snapshot.buffers if b.spec.owner is Owner.VMM)


def result(
    source: str,
    *,
    ledger_bytes: int,
    device_bytes: int | None,
    reason: str = "",
    basis: str = "",
    detail: dict[str, Any] | None = None,
    parts: dict[str, int] | None = None,
    uuid: str = "",
    gpu: str = "",
    total_bytes: int | None = None,
) -> dict[str, Any]:
    available = device_bytes is not None
    return {
        "source": source,
        "basis": basis if available else "",
        "available": available,
        "reason": reason,
        "device_bytes": device_bytes,
        "ledger_bytes": ledger_bytes,
        "unattributed_bytes": device_bytes - ledger_bytes if device_bytes is not None else None,
        "detail": detail or {},
        "parts": dict(parts or {}) if available else {},
        "uuid": uuid,
        "gpu": gpu,
        "total_bytes": total_bytes,
    }


class HostMemfdTruth:
    """Truth reader for the host backend: `physical_bytes` is `HostBackend.physical_bytes`.

    A driver call in flight (the background mapper creating a page's handles off the store's
    lock, or releasing them) changes the memfd's blocks before the store reports it, so a
    snapshot taken meanwhile read the device a page id ahead of (or behind) the ledger (over
    `kvledger bench sglang`'s churn without compaction, issue 23 saw 181 of 2,000 snapshots
    off by +8 MiB, 4 layers x 2 MiB: one page id's handle set being made; docs/sglang-bridge.md
    has a measurement). With `quiesce` (the page store's
    `quiescent`: its lock held, no driver call in flight) the ledger holds it across its
    copy of the accounts and `measure()`, the memfd read, so both are of one instant; the
    comparison is made after (`reconcile`), off the lock. Plain calls (`reader(snapshot)`)
    read at once, as before."""

    def __init__(
        self, physical_bytes: Callable[[], int], quiesce: Callable[[], Any] | None
    ) -> None:
        self.physical_bytes = physical_bytes
        self.quiesce = quiesce

    def measure(self) -> int | BaseException:
        try:
            return int(self.physical_bytes())
        except Exception as e:  # a closed backend, a vanished fd
            return e

    def reconcile(self, snapshot: Any, measured: int | BaseException) -> dict[str, Any]:
        ledger = vmm_physical_bytes(snapshot)
        if isinstance(measured, BaseException):
            return result(
                "host_memfd",
                ledger_bytes=ledger,
                device_bytes=None,
                reason=f"{type(measured).__name__}: {measured}",
            )
        return result("host_memfd", ledger_bytes=ledger, device_bytes=measured, basis="memfd")

    def __call__(self, snapshot: Any) -> dict[str, Any]:
        return self.reconcile(snapshot, self.measure())


def host_memfd_truth(
    physical_bytes: Callable[[], int], quiesce: Callable[[], Any] | None
) -> HostMemfdTruth:
    """Truth reader for the host backend (`HostMemfdTruth`); `quiesce`: a context manager
    factory during which no driver call is in flight (`PageStore.quiescent`). Required, so
    that every caller decides: None only where no driver call runs off the store's lock
    (no background mapper, no reaper whose frees the ledger has counted already)."""
    return HostMemfdTruth(physical_bytes, quiesce)
