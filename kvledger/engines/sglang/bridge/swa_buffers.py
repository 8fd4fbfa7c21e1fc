"""The bridged swa_kv family's buffers: what the ledger is told about them, and the native
copy a detach puts back in SGLang's pool."""

from __future__ import annotations

from typing import Any

from accounting.buffers import BufferSpec, Owner
from allocator.rows import RowFollower
from allocator.slots import SlotLayout
from kvledger.engines.sglang.bridge.compat import SwaFacts

FAMILY = "swa_kv"


def swa_specs(
    pool: Any, facts: SwaFacts, *, pool_name: str, layout: SlotLayout
) -> list[BufferSpec]:
    """The swa_kv family's buffers, one per layer, VMM-owned over `layout`."""
    start = int(getattr(pool, "_stage_start", 0) or 0)
    return [
        BufferSpec(
            name=f"{FAMILY}.L{start + i}",
            family=FAMILY,
            pool=pool_name,
            owner=Owner.VMM,
            layer=start + i,
            dtype="uint8",
            shape=(facts.rows, facts.row_bytes),
            slot_bytes=facts.token_bytes,
            capacity_slots=facts.rows * facts.page_tokens,
            tensor_bytes=facts.rows * facts.row_bytes,
            reserved_bytes=layout.reserved_bytes,
        )
        for i in range(facts.layers)
    ]


def native_copy(vmm: list[Any], follower: RowFollower, facts: SwaFacts) -> list[Any]:
    """Native tensors of SGLang's shape holding what `vmm` holds in row 0 (the padding row)
    and the rows `follower` holds; the other rows zero."""
    import torch

    rows = [0, *follower.held().tolist()]
    out = []
    for i in range(facts.layers):
        src = vmm[i]
        dst = torch.zeros((facts.rows, facts.row_bytes), dtype=torch.uint8, device=facts.devices[i])
        for row in rows:
            dst[row].copy_(src[row])
        out.append(dst)
    return out
