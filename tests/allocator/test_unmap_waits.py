"""Every unmap waits for every device access to its page (docs/allocator.md#the-cuda-fence-rule):
the store's close for work queued on pages still in use, the unmap transaction for a fence
not done yet, whoever calls it (a TP follower's trim among them). On the host backend,
with the device's queue modelled by tests.allocator.queued."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from allocator import HostBackend, SwaPool
from allocator.store import PageStore
from allocator.tp import TpCoordinator
from tests.allocator.queued import LateFence, QueuedDevice
from tests.allocator.rigs import SMALL_GRANULARITY

G = SMALL_GRANULARITY


@pytest.fixture
def dev() -> Iterator[QueuedDevice]:
    with HostBackend(G) as be:
        yield QueuedDevice(be)


def _queue_page(dev: QueuedDevice, store: PageStore, page: int) -> None:
    for layer in range(store.layers):
        dev.queue(store.address(layer, page), store.page_bytes)


def test_close_waits_for_work_queued_on_pages_still_in_use(dev: QueuedDevice) -> None:
    store = PageStore(dev, layers=2, page_bytes=G, num_pages=4)
    with store.lock:
        store.map_locked([1, 2])
        store.set_use(1, True)  # in use: no fence (a page gets one when it empties)
    _queue_page(dev, store, 1)  # e.g. its rows copied back into native buffers, still queued
    _queue_page(dev, store, 2)
    store.close()
    assert dev.faults == []
    assert dev.log[0] == "synchronize" and dev.syncs == 1
    assert dev.log.count("synchronize") == 1 and len(dev.log) == 1 + 2 * 2  # then 4 unmaps


def test_close_of_a_store_with_nothing_mapped_does_not_wait(dev: QueuedDevice) -> None:
    PageStore(dev, layers=2, page_bytes=G, num_pages=4).close()
    assert dev.syncs == 0


def test_an_unmap_waits_for_its_pages_fence_first(dev: QueuedDevice) -> None:
    store = PageStore(dev, layers=2, page_bytes=G, num_pages=4, max_spare_pages=4)
    fence = LateFence(dev.log, "page 1")
    with store.lock:
        store.map_locked([1])
        store.policy.fence([1], fence)
        assert store.unmap_spare_locked(1)
    assert dev.log[0] == "wait page 1" and dev.log[1].startswith("unmap ")
    store.close()


@pytest.fixture
def world1(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'w1'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_a_tp_followers_trim_waits_for_a_fence_not_done(world1: Any) -> None:
    from tests.allocator.tp import tp_worker

    with (
        HostBackend(tp_worker.GRANULARITY) as be,
        SwaPool(QueuedDevice(be), layers=2, layout=tp_worker.LAYOUT, max_spare_pages=1) as pool,
    ):
        dev = cast(QueuedDevice, pool.store.pages.backend)
        with TpCoordinator(pool, timeout_s=5) as tp:
            store = pool.store
            ids = pool.alloc(40)  # 584-byte slots: several 4 KiB pages
            pool.free(ids)  # pages emptied: one spare kept (max_spare_pages=1)
            with store.lock:
                (spare,) = store.spares
                fence = LateFence(dev.log, f"page {spare}")
                store.policy.fence([spare], fence)
                dev.log.clear()
                store.policy.max_spare_pages = 0
                tp.trim_locked()  # rank 0's plan names the fenced spare; it goes at once
            assert dev.log[0] == f"wait page {spare}", dev.log
            assert store.state[spare] == 0 and fence.waited
