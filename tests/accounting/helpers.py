"""Builders of buffer specs and accounts for the ledger tests."""

from __future__ import annotations

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger

PAGE = 2 << 20


def vmm_specs(
    pool: str,
    family: str,
    layers: int,
    *,
    slot_bytes: int = 584,
    capacity: int = 4096,
    reserved_pages: int = 4,
) -> list[BufferSpec]:
    tensor = capacity * slot_bytes
    return [
        BufferSpec(
            name=f"{family}.{i}",
            family=family,
            pool=pool,
            owner=Owner.VMM,
            layer=i,
            dtype="uint8",
            shape=(capacity, slot_bytes),
            slot_bytes=slot_bytes,
            capacity_slots=capacity,
            tensor_bytes=tensor,
            reserved_bytes=reserved_pages * PAGE,
        )
        for i in range(layers)
    ]


def runtime_specs(pool: str, family: str, layers: int, *, rows: int = 100, row_bytes: int = 64):
    return [
        BufferSpec(
            name=f"{family}.{i}",
            family=family,
            pool=pool,
            owner=Owner.RUNTIME,
            layer=i,
            dtype="float32",
            shape=(rows, row_bytes // 4),
            slot_bytes=row_bytes,
            capacity_slots=rows,
            tensor_bytes=rows * row_bytes,
            reserved_bytes=rows * row_bytes,
        )
        for i in range(layers)
    ]


def vmm_account(
    ledger: Ledger, pool: str = "swa", family: str = "swa_kv", layers: int = 3, **kw
) -> Account:
    return ledger.add_account(vmm_specs(pool, family, layers, **kw), page_bytes=PAGE)
