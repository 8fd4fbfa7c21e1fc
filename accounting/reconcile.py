"""Reconciliation: the ledger's figures held against what the device itself reports.

A truth reader is a callable `reader(snapshot) -> dict` given to
`Ledger.add_truth`; the ledger calls it under its lock while taking a snapshot, so
no allocator event lands between the figures and the truth. Every reader returns
a dict made by `result()`:

    {"truth": str,              # which truth: "host_memfd", "nvml", ...
     "scope": str,              # which ledger figure it is held against
     "truth_bytes": int,        # what the device reports
     "ledger_bytes": int,       # what the ledger counts for the same scope
     "unattributed_bytes": int} # truth_bytes - ledger_bytes: memory no buffer accounts for

plus any extra keys. The exporter turns each into `kvledger_truth_bytes` and
`kvledger_unattributed_bytes{truth=...}`.

`host_truth` reads the host backend (the memfd's allocated blocks) against the
physical bytes of the VMM buffers. NVML / CUDA truth lives in `accounting.nvml`,
which provides the same shape of reader. This module imports neither allocator
nor a driver: the backend's reading is passed in as a callable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accounting.buffers import Owner
from accounting.snapshot import Snapshot

TruthReader = Callable[[Snapshot], dict[str, Any]]


def result(
    truth: str, scope: str, truth_bytes: int, ledger_bytes: int, **extra: Any
) -> dict[str, Any]:
    for name, value in (("truth_bytes", truth_bytes), ("ledger_bytes", ledger_bytes)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"reconcile {truth!r}: {name}={value!r}, expected an int")
    return {
        "truth": truth,
        "scope": scope,
        "truth_bytes": truth_bytes,
        "ledger_bytes": ledger_bytes,
        "unattributed_bytes": truth_bytes - ledger_bytes,
        **extra,
    }


def vmm_physical_bytes(snapshot: Snapshot) -> int:
    """Physical bytes of the VMM-owned buffers in `snapshot` (what a VMM backend holds)."""
    return sum(b.physical_bytes for b in snapshot.buffers if b.spec.owner is Owner.VMM)


def host_truth(physical_bytes: Callable[[], int], *, name: str = "host_memfd") -> TruthReader:
    """A reader holding a host backend's `physical_bytes()` (kernel-allocated memfd blocks)
    against the VMM physical bytes of the snapshot."""

    def read(snapshot: Snapshot) -> dict[str, Any]:
        return result(
            name, "vmm physical_bytes", int(physical_bytes()), vmm_physical_bytes(snapshot)
        )

    return read
