"""kvledger.engines.sglang.bridge.reorder: the same ids, ordered by their keys, ties kept in list
order, the dtype and device kept; on the host and (marker gpu) on cuda:0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvledger.engines.sglang.bridge.reorder import reorder


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_reorder_sorts_ids_by_their_keys_stably(device: str) -> None:
    free = torch.tensor([5, 2, 9, 7, 3], dtype=torch.int32, device=device)
    keys = np.zeros(10, np.int64)
    keys[[9, 3]] = -1  # first, in list order: 9 before 3
    keys[7] = 5  # last
    out = reorder(free, keys)  # on CUDA: the keys go up without a sync; tolist syncs here
    assert out.tolist() == [9, 3, 5, 2, 7]
    assert out.dtype == free.dtype and out.device == free.device
    assert free.tolist() == [5, 2, 9, 7, 3]  # the list given is not written
