"""The memory the bridge gives back, over `kvledger bench sglang`'s churning trace: the swa_kv
family's physical bytes against the bytes SGLang occupies and against the native pool's.

At each sample past the warm-up (after an event and the compaction step the production
policy takes, `kvledger.engines.sglang.bridge.compact_policy`):

    physical  the bridge's physical bytes (handle sets alive, mapped or kept: what the
              device holds for the family; `Bridge.stats()["physical_bytes"]`)
    occupied  the rows SGLang holds plus its padding row, times the row bytes, in every layer
    native    the native pool's SWA buffers: every row, in every layer

`physical / occupied` says how much the VMM pool holds beyond what is in use (spares,
pages in use by a few rows, kept handles); `physical / native` what a server keeps of the
native pool's memory. Each is reported as mean and max over the samples.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SwaMemory:
    row_bytes: int
    layers: int
    rows: int  # SGLang's SWA pages, the padding row excluded
    by_occupied: list[float] = field(default_factory=list)
    by_native: list[float] = field(default_factory=list)

    def add(self, physical: int, held_rows: int) -> None:
        per_row = self.row_bytes * self.layers
        self.by_occupied.append(physical / ((held_rows + 1) * per_row))
        self.by_native.append(physical / ((self.rows + 1) * per_row))

    def result(self) -> dict[str, Any]:
        def mm(xs: list[float]) -> dict[str, float]:
            return {"mean": statistics.fmean(xs), "max": max(xs)} if xs else {}

        return {
            "samples": len(self.by_occupied),
            "physical_per_occupied": mm(self.by_occupied),
            "physical_per_native": mm(self.by_native),
        }


def report_line(memory: dict[str, Any], policy: dict[str, Any]) -> str:
    """One line of the bench's text report."""
    o, n = memory["physical_per_occupied"], memory["physical_per_native"]
    return (
        f"    swa_kv physical / occupied: mean {o['mean']:.2f}x, max {o['max']:.2f}x; "
        f"physical / native: mean {n['mean']:.2f}x, max {n['max']:.2f}x "
        f"({memory['samples']} samples; compaction policy: {policy['describe']})"
    )
