"""A snapshot's rows: one per buffer (`BufferRow`), one per account (`AccountRow`).

Plain records of the ledger's figures, as a snapshot holds them and a snapshot file
carries them (`accounting.snapshot`, `accounting.snapfile`); the relations they must keep
are `accounting.relations`'. They import only the buffer spec and the figures, so every
module that checks or rolls them up sits above them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.figures import Held


@dataclass(frozen=True)
class BufferRow:
    spec: BufferSpec
    account: str
    physical_bytes: int
    mapped_bytes: int
    occupied_slots: int
    page_bytes: int

    @property
    def occupied_bytes(self) -> int:
        return self.occupied_slots * self.spec.slot_bytes

    def figures(self) -> dict[str, int]:
        return {
            "tensor_bytes": self.spec.tensor_bytes,
            "reserved_bytes": self.spec.reserved_bytes,
            "physical_bytes": self.physical_bytes,
            "mapped_bytes": self.mapped_bytes,
            "occupied_bytes": self.occupied_bytes,
            "occupied_slots": self.occupied_slots,
            "capacity_slots": self.spec.capacity_slots,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.spec.to_dict(),
            "account": self.account,
            "page_bytes": self.page_bytes,
            "physical_bytes": self.physical_bytes,
            "mapped_bytes": self.mapped_bytes,
            "occupied_slots": self.occupied_slots,
            "occupied_bytes": self.occupied_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferRow:
        return cls(
            spec=BufferSpec.from_dict(d),
            account=d["account"],
            physical_bytes=d["physical_bytes"],
            mapped_bytes=d["mapped_bytes"],
            occupied_slots=d["occupied_slots"],
            page_bytes=d["page_bytes"],
        )


@dataclass(frozen=True)
class AccountRow:
    key: str
    family: str
    pool: str
    owner: Owner
    page_bytes: int
    capacity_slots: int
    occupied_slots: int
    peak_occupied_slots: int
    handle_pages: int
    peak_handle_pages: int
    mapped_pages: int
    pages_mapped_total: int
    pages_unmapped_total: int
    map_seconds_total: float
    unmap_seconds_total: float
    map_calls: int
    map_bucket_counts: tuple[int, ...]
    # driver/OS calls of the VMM allocator that failed (accounting.events.DRIVER_FAILURES)
    driver_failures_total: int = 0
    # bytes one slot takes over all the account's buffers (sum of their slot_bytes)
    slot_bytes: int = 0
    # occupied_slots split by holder (accounting.figures.Held; they add up to it)
    held_tree_protected: int = 0
    held_tree_evictable: int = 0
    held_request_only: int = 0
    held_unattributed: int = 0
    # slots the engine's prefix tree evicted, and slots freed as they left a sliding window
    evicted_slots_total: int = 0
    window_evicted_slots_total: int = 0

    @property
    def held(self) -> Held:
        """occupied_slots by holder."""
        return Held(
            self.held_tree_protected,
            self.held_tree_evictable,
            self.held_request_only,
            self.held_unattributed,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["owner"] = self.owner.value
        d["map_bucket_counts"] = list(self.map_bucket_counts)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AccountRow:
        return cls(
            **{**d, "owner": Owner(d["owner"]), "map_bucket_counts": tuple(d["map_bucket_counts"])}
        )
