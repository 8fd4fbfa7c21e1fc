"""The ledger's description of a VMM pool's layer buffers, derived from its layout."""

from __future__ import annotations

from accounting.buffers import BufferSpec, Owner
from allocator.slots.layout import SlotLayout


def vmm_layer_specs(
    layout: SlotLayout,
    layers: int,
    *,
    family: str = "swa_kv",
    pool: str = "swa",
    null_slot: bool = True,
    dtype: str = "uint8",
    shape: tuple[int, ...] | None = None,
) -> list[BufferSpec]:
    """One VMM-owned `BufferSpec` per layer: tensor bytes are the buffer's full extent, reserved
    bytes its page-rounded reservation; capacity leaves out the null slot when the pool keeps one."""
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError(f"layers={layers!r}, expected a positive int")
    return [
        BufferSpec(
            name=f"{family}.L{layer}",
            family=family,
            pool=pool,
            owner=Owner.VMM,
            layer=layer,
            dtype=dtype,
            shape=shape or (layout.rows, layout.row_bytes),
            slot_bytes=layout.slot_bytes,
            capacity_slots=layout.capacity_slots - int(null_slot),
            tensor_bytes=layout.buffer_bytes,
            reserved_bytes=layout.reserved_bytes,
        )
        for layer in range(layers)
    ]
