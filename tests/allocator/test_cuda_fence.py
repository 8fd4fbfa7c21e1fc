"""On a GPU: the CUDA fence rule and the read-back without a device synchronisation.

A page given back while a kernel that reads it is still queued stays mapped until the event
recorded after the give-back has completed (unmapping it under the kernel would fault and
poison the context, docs/background.md#cuda-driver-facts); the ids are read through a
pinned copy whose event has not completed while the stream is busy; the kernel's result is
correct, and the page is unmapped once the stream has drained.

    .venv/bin/python -m pytest tests/allocator/test_cuda_fence.py -q -m gpu
"""

from __future__ import annotations

import pytest

from allocator.mapper import BackgroundMapper
from allocator.rows import RowFollower
from allocator.store import PageStore
from kvledger.sglang_bridge.readback import CudaReader

pytestmark = pytest.mark.gpu

ROW_BYTES = 149_760  # DeepSeek-V4's SWA row: 256 tokens
ROWS = 256
LAYERS = 4


def _busy_kernel(torch: object) -> None:
    # Keep the stream busy for a while (about 100 ms on an H200) before the reads.
    torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]


@pytest.mark.parametrize("mapper", [False, True], ids=["sync", "background"])
def test_a_page_in_use_by_a_queued_kernel_is_unmapped_only_after_it_ran(mapper: bool) -> None:
    import torch

    from allocator.cuda import CudaBackend

    torch.cuda.init()
    backend = CudaBackend(0)
    gran = backend.granularity
    pages = -(-ROWS * ROW_BYTES // gran)
    store = PageStore(
        backend,
        layers=LAYERS,
        page_bytes=gran,
        num_pages=pages,
        max_spare_pages=0,
        handle_pool_pages=0,
    )
    try:
        follower = RowFollower(store, rows=ROWS, row_bytes=ROW_BYTES)
        views = [
            store.byte_tensor(i, ROWS * ROW_BYTES).view(ROWS, ROW_BYTES) for i in range(LAYERS)
        ]
        rows = list(range(100, 110))
        follower.take(rows)
        for v in views:
            v[rows] = 7
        torch.cuda.synchronize()
        reader = CudaReader("cuda:0")
        ids = torch.tensor(rows, device="cuda")
        _busy_kernel(torch)
        sums = [v[rows].float().sum() for v in views]  # queued behind the sleep
        pending = reader.read(ids)  # the engine frees the rows: read back, no sync
        assert not pending.ready()  # the stream is still busy: nothing waited for it
        page_ids = follower.pages_of(rows)
        follower.give_back(rows, reader.fence(pending))  # as the hooks do once ids are known
        bg = BackgroundMapper(store, idle_seconds=0.01) if mapper else None
        try:
            assert all(store.is_mapped(p) for p in page_ids)  # fenced: still mapped
            torch.cuda.synchronize()
            assert [float(s) for s in sums] == [7.0 * len(rows) * ROW_BYTES] * LAYERS
            if bg is not None:
                assert bg.wait_idle()
            else:
                follower.take([200])
                follower.give_back([200])  # the next release finds the fence done
        finally:
            if bg is not None:
                bg.close()
        assert not any(store.is_mapped(p) for p in page_ids if p not in follower.pages_of([0]))
        assert reader.waits == 0
    finally:
        store.close()
        backend.close()
