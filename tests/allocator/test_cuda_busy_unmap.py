"""On a GPU kept busy by another process: a page store's close unmaps pages still in use only
after the device work queued on them has run (issue 23: `Bridge.detach()` queued its
copy-back and closed the store, and on a busy H200 the copy read unmapped pages,
`cudaErrorIllegalAddress`). The store runs in a child process (a fault kills its CUDA
context), beside a hog child running bf16 matmuls.

    .venv/bin/python -m pytest tests/allocator/test_cuda_busy_unmap.py -q -m gpu -rP
    # what it catches, without the store's drain (expect an error or wrong bytes):
    python -m tests.allocator.cuda_busy_probe close --no-drain --rounds 10
"""

from __future__ import annotations

import pytest

from tests.allocator.cuda_busy_probe import PROBE, beside_a_hog

pytestmark = pytest.mark.gpu


def test_close_beside_a_gpu_hog_unmaps_after_the_queued_copy_back() -> None:
    got = beside_a_hog([PROBE, "close", "--rounds", "20"], hog_seconds=120, timeout=240)
    assert got == {"rounds": 20, "wanted": 20, "wrong_bytes": 0, "error": "", "drain": True}
