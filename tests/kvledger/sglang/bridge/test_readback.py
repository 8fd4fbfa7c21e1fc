"""The host reader: each (tensor, n) read as its first n values (all with None), whatever
the tensor's shape; the CUDA reader is exercised on the H200 by tests/allocator/test_cuda_fence.py
and the bridge's GPU tests."""

from __future__ import annotations

import torch

from kvledger.sglang.bridge.readback import HostReader


def test_host_read_takes_the_first_n_of_each_tensor_flattened() -> None:
    base = torch.arange(40, dtype=torch.int64)
    items = [
        (base[3:20], 5),  # a view not at offset 0
        (base[:6].reshape(2, 3), None),  # 2-D: read flattened
        (base[10:30].reshape(4, 5), 7),  # 2-D with a count
        (base[:0], None),  # empty
        (torch.tensor([7], dtype=torch.int32), 1),
    ]
    read = HostReader().read_many(items)
    assert read.ready()
    assert read.lists() == [
        [3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5],
        [10, 11, 12, 13, 14, 15, 16],
        [],
        [7],
    ]
    assert all(type(v) is int for lst in read.lists() for v in lst)
