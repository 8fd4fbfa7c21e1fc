"""Reordering SGLang's free list in place of its own order, on its device, without a sync.

Packing (allocator.rows.packing) says in which order the free rows should be handed out; SGLang's
paged allocator takes from the front of `free_pages` and accepts any permutation of the same
ids (it sorts on a merge). `reorder` computes that permutation where the list lives: a key
per row goes up (a pinned, non-blocking copy for a CUDA list), the list is sorted by it on
the device, and nothing is read back.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def reorder(free: Any, keys: np.ndarray) -> Any:
    """`free` (page ids) sorted by `keys[id]`, stably, on `free`'s device."""
    import torch

    k = torch.from_numpy(keys)
    if free.device.type != "cpu":
        k = k.pin_memory().to(free.device, non_blocking=True)
    order = torch.argsort(k[free.long()], stable=True)
    return free[order]
