"""BufferSpec and runtime_buffer: what a buffer is, validated and serialisable."""

from __future__ import annotations

import pytest
import torch

from accounting.buffers import BufferSpec, Owner, dtype_name, runtime_buffer
from tests.accounting.helpers import vmm_specs


def test_spec_round_trips() -> None:
    spec = vmm_specs("swa", "swa_kv", 2)[1]
    assert BufferSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "field", ["slot_bytes", "capacity_slots", "tensor_bytes", "reserved_bytes"]
)
def test_negative_sizes_are_refused_by_name(field: str) -> None:
    d = vmm_specs("swa", "swa_kv", 1)[0].to_dict()
    d[field] = -1
    with pytest.raises(ValueError, match=f"{field}=-1"):
        BufferSpec.from_dict(d)


def test_owner_must_be_an_owner() -> None:
    d = vmm_specs("swa", "swa_kv", 1)[0].to_dict()
    with pytest.raises(ValueError, match="owner"):
        BufferSpec(**{**BufferSpec.from_dict(d).__dict__, "owner": "vmm"})


def test_runtime_buffer_of_a_bf16_state_tensor() -> None:
    t = torch.zeros(128, 1024, dtype=torch.bfloat16)
    spec = runtime_buffer(t, name="c128_state.1", family="c128_state", pool="c128", layer=1)
    assert spec.owner is Owner.RUNTIME
    assert spec.dtype == "bfloat16"
    assert spec.shape == (128, 1024)
    assert spec.tensor_bytes == spec.reserved_bytes == 128 * 1024 * 2
    assert (spec.capacity_slots, spec.slot_bytes) == (128, 2048)


def test_runtime_buffer_with_explicit_capacity() -> None:
    t = torch.zeros(4096, 584, dtype=torch.uint8)
    spec = runtime_buffer(t, name="c4", family="c4_kv", pool="c4", layer=2, capacity_slots=64)
    assert spec.capacity_slots == 64 and spec.slot_bytes == 4096 * 584 // 64


def test_a_view_counts_its_whole_storage_as_reserved() -> None:
    base = torch.zeros(100, 8, dtype=torch.float32)
    spec = runtime_buffer(base[:10], name="v", family="c4_kv", pool="c4", layer=None)
    assert spec.tensor_bytes == 10 * 8 * 4
    assert spec.reserved_bytes == 100 * 8 * 4


def test_dtype_name() -> None:
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    assert dtype_name("fp8") == "fp8"
