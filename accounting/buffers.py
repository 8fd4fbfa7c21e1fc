"""What a buffer is: its identity, layout and static sizes.

A buffer is one tensor handed to the model (for example one layer's SWA KV
buffer). Its dynamic figures live in the `Account` it belongs to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Owner(str, enum.Enum):
    VMM = "vmm"  # backed page by page by a VMM allocator
    RUNTIME = "runtime"  # an ordinary tensor the engine allocated whole


@dataclass(frozen=True)
class BufferSpec:
    name: str
    family: str
    pool: str
    owner: Owner
    layer: int | None
    dtype: str
    shape: tuple[int, ...]
    slot_bytes: int
    capacity_slots: int
    tensor_bytes: int
    reserved_bytes: int

    def __post_init__(self) -> None:
        for field in ("slot_bytes", "capacity_slots", "tensor_bytes", "reserved_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"buffer {self.name!r}: {field}={value!r}, expected a non-negative int"
                )
        if not isinstance(self.owner, Owner):
            raise ValueError(f"buffer {self.name!r}: owner={self.owner!r}, expected an Owner")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "pool": self.pool,
            "owner": self.owner.value,
            "layer": self.layer,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "slot_bytes": self.slot_bytes,
            "capacity_slots": self.capacity_slots,
            "tensor_bytes": self.tensor_bytes,
            "reserved_bytes": self.reserved_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferSpec:
        return cls(
            name=d["name"],
            family=d["family"],
            pool=d["pool"],
            owner=Owner(d["owner"]),
            layer=d["layer"],
            dtype=d["dtype"],
            shape=tuple(d["shape"]),
            slot_bytes=d["slot_bytes"],
            capacity_slots=d["capacity_slots"],
            tensor_bytes=d["tensor_bytes"],
            reserved_bytes=d["reserved_bytes"],
        )


def dtype_name(dtype: Any) -> str:
    """`torch.float8_e4m3fn` -> "float8_e4m3fn"; strings pass through."""
    return str(dtype).removeprefix("torch.")


def runtime_buffer(
    tensor: Any,
    *,
    name: str,
    family: str,
    pool: str,
    layer: int | None,
    capacity_slots: int | None = None,
) -> BufferSpec:
    """Describe an ordinary tensor: its storage is its reservation and its physical memory.

    Slots are rows along dim 0 unless `capacity_slots` says otherwise.
    """
    shape = tuple(int(s) for s in tensor.shape)
    tensor_bytes = int(tensor.numel()) * int(tensor.element_size())
    storage = int(tensor.untyped_storage().nbytes())
    slots = shape[0] if capacity_slots is None and shape else (capacity_slots or 0)
    slot_bytes = tensor_bytes // slots if slots else 0
    return BufferSpec(
        name=name,
        family=family,
        pool=pool,
        owner=Owner.RUNTIME,
        layer=layer,
        dtype=dtype_name(tensor.dtype),
        shape=shape,
        slot_bytes=slot_bytes,
        capacity_slots=slots,
        tensor_bytes=tensor_bytes,
        reserved_bytes=max(storage, tensor_bytes),
    )
