"""Stand-ins for the bridge's tests (no sglang).

- `FreeList`: SGLang 0.5.23's PagedTokenToKVPoolAllocator's free list, the six methods the
  bridge wraps with the same list semantics (allocations take from the front and replace
  the list by a view of the rest; releases go in front, or are staged with `need_sort`
  until a merge sorts them in). The real class is in the `sglang` tests.
- `FakeEvent` and `LateReader`: the CUDA read-back path on CPU (readback.CudaRead over a
  stand-in event): ids copied at the read, landing when the test completes their event, or
  after a random number of later reads.
- `PolicyRig`: a page store on the host backend, a RowFollower, a FreeList, its
  FrontPolicy and AllocatorHooks (installed).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from allocator.host import HostBackend
from allocator.rows import RowFollower
from allocator.store import PageStore
from kvledger.engines.sglang.bridge.allocator_hooks import BATCH, AllocatorHooks
from kvledger.engines.sglang.bridge.compat import expected_row_bytes
from kvledger.engines.sglang.bridge.front_policy import FrontPolicy
from kvledger.engines.sglang.bridge.readback import CudaRead

ROW = expected_row_bytes(256)  # SGLang's DSV4 SWA row of one 256-token page
GRAN = 48 * 4096  # >= one row; rows straddle VMM pages now and then


def row_pages(row: int, *, row_bytes: int = ROW, gran: int = GRAN) -> set[int]:
    """The VMM pages row `row` touches."""
    start = row * row_bytes
    return set(range(start // gran, (start + row_bytes - 1) // gran + 1))


class FreeList:
    def __init__(self, pages: int, *, need_sort: bool = False) -> None:
        self.num_pages = pages
        self.page_size = 256
        self.need_sort = need_sort
        self.staged_pages: list[Any] = []
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.staged_pages = []

    def get_all_free_pages(self) -> Any:
        return torch.cat((self.free_pages, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        if self.staged_pages:
            self.free_pages, _ = torch.sort(self.get_all_free_pages())
            self.staged_pages = []

    def _take(self, n: int) -> Any:
        if n > len(self.free_pages):
            self.merge_and_sort_free()
        if n > len(self.free_pages):
            return None
        out = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return out

    def alloc(self, n: int) -> Any:
        return self._take(n)

    def alloc_extend(self, n: int) -> Any:
        return self._take(n)

    def alloc_decode(self, n: int) -> Any:
        return self._take(n)

    def _release_page_ids(self, *page_ids: Any) -> None:
        if self.need_sort:
            self.staged_pages.extend(page_ids)
        else:
            self.free_pages = torch.cat((*page_ids, self.free_pages))

    def held(self) -> list[int]:
        free = set(self.get_all_free_pages().tolist())
        return [p for p in range(1, self.num_pages + 1) if p not in free]


class FakeEvent:
    """A CUDA event's two calls: not complete until the test (or a wait) says."""

    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True


class LateReader:
    """The CUDA read-back on CPU: each read's ids are copied at once and land when their
    event completes: when the test sets `complete` on `events`, or, with `rng`, after 0 to 3
    later reads (some replays then stop short of a batch; one that needs it waits)."""

    device = "cpu"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng
        self.waits = 0
        self.events: list[FakeEvent] = []
        self.given_back = 0
        self._pending: list[tuple[int, FakeEvent]] = []  # (reads left, event) with `rng`

    def read_many(self, items: list[tuple[Any, int | None]]) -> CudaRead:
        ev = FakeEvent()
        if self.rng is not None:
            for k, (left, old) in enumerate(self._pending):
                self._pending[k] = (left - 1, old)
                old.complete = old.complete or left <= 1
            self._pending = [p for p in self._pending if not p[1].complete]
            self._pending.append((self.rng.randint(0, 3), ev))
        self.events.append(ev)
        lists = [t.reshape(-1)[:n].tolist() for t, n in items]  # copied now, read later
        flat = torch.tensor([x for one in lists for x in one], dtype=torch.int64)
        return CudaRead(flat, flat, [len(x) for x in lists], ev, self)

    def give_back(self, buffer: Any, event: Any) -> None:
        self.given_back += 1  # CudaRead.lists gives each read's buffer back once

    def land_all(self) -> None:
        for ev in self.events:
            ev.complete = True

    def fence_now(self) -> None:
        return None

    def stream_fence(self) -> None:
        return None


class PolicyRig:
    """`pages` SGLang pages (rows 1..pages, row 0 the padding row) on a one-layer page store,
    followed; the hooks installed."""

    def __init__(
        self,
        *,
        pages: int = 16,
        need_sort: bool = False,
        batch: int = BATCH,
        reader: Any = None,
        **store_options: Any,
    ) -> None:
        self.backend = HostBackend(granularity=GRAN)
        rows = pages + 1
        self.store = PageStore(
            self.backend,
            layers=1,
            page_bytes=GRAN,
            num_pages=-(-rows * ROW // GRAN) + 1,
            **store_options,
        )
        self.follower = RowFollower(self.store, rows=rows, row_bytes=ROW)
        self.alloc = FreeList(pages, need_sort=need_sort)
        self.policy = FrontPolicy(self.alloc, self.follower, reader=reader, ahead_rows=0)
        self.hooks = AllocatorHooks(self.alloc, self.policy, batch=batch)
        self.hooks.install()

    def without_budget_replays(self) -> None:
        """Only a full batch replays from here on (the budget out of reach)."""
        far = 1 << 40
        self.policy.set_budget(far, far, "test: only a full batch replays")

    def unmapped_rows(self) -> list[int]:
        """Rows SGLang holds that touch a page not mapped."""
        return [
            r
            for r in self.alloc.held()
            if not all(self.store.is_mapped(p) for p in self.follower.pages_of([r]))
        ]

    def close(self) -> None:
        self.hooks.remove()
        self.store.close()
        self.backend.close()
