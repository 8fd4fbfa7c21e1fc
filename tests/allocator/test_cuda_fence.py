"""On a GPU: the CUDA fence rule and the read-back without a device synchronisation.

A page given back while a kernel that reads it is still queued stays mapped until the event
recorded after the give-back has completed (unmapping it under the kernel would fault and
poison the context, docs/background.md#cuda-driver-facts); the ids are read through a
pinned copy whose event has not completed while the stream is busy; the kernel's result is
correct, and the page is unmapped once the stream has drained.

    .venv/bin/python -m pytest tests/allocator/test_cuda_fence.py -q -m gpu
"""

from __future__ import annotations

import time

import pytest

from allocator.mapper import BackgroundMapper
from allocator.rows import RowFollower
from allocator.store import PageStore
from kvledger.engines.sglang.bridge.readback import CudaReader

pytestmark = pytest.mark.gpu

ROW_BYTES = 149_760  # DeepSeek-V4's SWA row: 256 tokens
ROWS = 256
LAYERS = 4


def _busy_kernel(torch: object) -> None:
    # Keep the stream busy for a while (about 100 ms on an H200) before the reads.
    torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]


def test_a_page_in_use_by_a_queued_kernel_is_unmapped_only_after_it_ran() -> None:
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
        side = torch.cuda.Stream()  # the reads run on another stream, as a forward may
        with torch.cuda.stream(side):
            _busy_kernel(torch)
            sums = [v[rows].float().sum() for v in views]  # queued behind the sleep
        read = reader.read_many([(ids, None)])  # the engine frees the rows: read back, no sync
        page_ids = [p for p in follower.pages_of(rows) if p not in follower.pages_of([0])]
        follower.give_back(read.lists()[0], reader.fence_now())
        follower.take([200])
        follower.give_back([200])  # a release on the allocating thread: fenced, nothing waits
        assert all(store.is_mapped(p) for p in page_ids)
        with BackgroundMapper(store, idle_seconds=0.01) as bg:  # waits for the device, unmaps
            time.sleep(0.01)
            assert all(store.is_mapped(p) for p in page_ids) or torch.cuda.Stream.query(side)
            assert bg.wait_idle(timeout=30)
            assert [float(x) for x in sums] == [7.0 * len(rows) * ROW_BYTES] * LAYERS
        assert not any(store.is_mapped(p) for p in page_ids)
        assert reader.waits <= 1  # at most the read of the ids themselves
    finally:
        store.close()
        backend.close()
