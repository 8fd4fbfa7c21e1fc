"""kvledger.sglang.bridge.front_policy on a stand-in free list (no sglang): the budget, the
cover of an allocation past the pins, idle replays, and the rule that every row handed out
is on mapped pages when SGLang's method returns. The same against SGLang's own allocator:
test_bridge.py."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from allocator.host import HostBackend
from allocator.rows import RowFollower
from allocator.store import PageStore
from kvledger.sglang.bridge.allocator_hooks import AllocatorHooks
from kvledger.sglang.bridge.compat import expected_row_bytes
from kvledger.sglang.bridge.front_policy import IDLE_FLUSH_S, FrontPolicy
from kvledger.sglang.bridge.readback import CudaRead
from tests.kvledger.sglang.bridge.freelist import FreeList

ROW = expected_row_bytes(256)
GRAN = 48 * 4096  # a row straddles VMM pages now and then
PAGES = 24


class Event:
    """A CUDA event's two calls, completed by the test (or by waiting on it)."""

    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True


class LateReader:
    """The CUDA read-back on CPU: ids are copied at the read and land when the test (or a
    random draw at each later read, with `rng`) completes their event."""

    device = "cpu"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng
        self.waits = 0
        self.events: list[Event] = []

    def read_many(self, items: list[tuple[Any, int | None]]) -> CudaRead:
        if self.rng is not None:
            for ev in self.events:
                ev.complete = ev.complete or self.rng.random() < 0.3
        lists = [t.reshape(-1)[:n].tolist() for t, n in items]
        self.events.append(Event())
        flat = torch.tensor([x for one in lists for x in one], dtype=torch.int64)
        return CudaRead(flat, [len(x) for x in lists], self.events[-1], self)

    def fence_now(self) -> None:
        return None

    def stream_fence(self) -> None:
        return None


class Rig:
    def __init__(self, *, reader: Any = None, **store_options: object) -> None:
        self.backend = HostBackend(granularity=GRAN)
        rows = PAGES + 1
        self.store = PageStore(
            self.backend,
            layers=1,
            page_bytes=GRAN,
            num_pages=-(-rows * ROW // GRAN) + 1,
            **store_options,  # type: ignore[arg-type]
        )
        self.follower = RowFollower(self.store, rows=rows, row_bytes=ROW)
        self.alloc = FreeList(PAGES)
        self.policy = FrontPolicy(self.alloc, self.follower, reader=reader, ahead_rows=0)
        self.hooks = AllocatorHooks(self.alloc, self.policy)
        self.hooks.install()

    def unmapped_rows(self) -> list[int]:
        held = self.alloc.held()
        return [
            r for r in held if not all(self.store.is_mapped(p) for p in self.follower.pages_of([r]))
        ]

    def close(self) -> None:
        self.hooks.remove()
        self.store.close()
        self.backend.close()


@pytest.fixture
def r() -> Iterator[Rig]:
    rg = Rig(max_spare_pages=1)
    yield rg
    rg.close()


def test_start_pins_the_mapped_front_and_says_so(r: Rig) -> None:
    state = r.policy.debug_state()
    assert state["budget_reason"] == "pin: the mapped front"
    assert state["front"] == list(range(1, PAGES + 1))  # SGLang's whole list, as read
    assert state["safe_until"] <= state["net"] + PAGES


def test_an_allocation_past_the_pins_is_covered_before_it_returns() -> None:
    """Its ids not read yet (a CUDA read in flight), an allocation past the pinned rows has
    the next rows of the front last read mapped and pinned before SGLang's method returns,
    without waiting for the read."""
    rg = Rig(reader=LateReader(), max_spare_pages=1)
    try:
        safe = rg.policy.safe_until
        got = rg.alloc.alloc(safe + 3)  # past the pinned rows
        assert rg.follower.held_rows == 0  # not replayed: the read has not landed
        assert rg.unmapped_rows() == []  # ... yet its rows are mapped
        assert set(rg.follower.pages_of(got.tolist())) <= set(rg.store.pinned)
        assert rg.policy.forced == 0 and rg.policy.reader.waits == 0
        assert rg.follower.waited >= 1  # mapped on the allocating thread
        assert rg.policy.debug_state()["budget_reason"].startswith("cover")
        rg.policy.flush()  # waits for the read
        assert rg.follower.held().tolist() == rg.alloc.held()
    finally:
        rg.close()


def test_the_idle_replay_waits_for_the_journal_to_be_left_alone(r: Rig) -> None:
    r.policy.set_budget(1 << 40, 1 << 40, "test: no budget replay")
    r.alloc.alloc(1)
    r.policy.idle_flush()  # first look: starts the clock
    r.policy.idle_flush()  # too soon
    assert len(r.policy.journal) == 1
    time.sleep(IDLE_FLUSH_S * 2)
    r.policy.idle_flush()
    assert len(r.policy.journal) == 0 and r.follower.held().tolist() == r.alloc.held()


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("spares", [0, 2])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_row_handed_out_is_mapped_when_the_call_returns(
    seed: int, spares: int, late: bool
) -> None:
    """Random allocations and releases, with every spare not pinned unmapped after each call
    (the harshest trim): SGLang's held rows are on mapped pages after every call, with the
    ids read at once (host) or landing several replays late (CUDA-like: then the pins and
    the cover keep the rows handed out before their replay mapped)."""
    rng = random.Random(seed)
    reader = LateReader(random.Random(seed)) if late else None
    rg = Rig(reader=reader, max_spare_pages=spares, handle_pool_pages=0)
    try:
        held: list[int] = []
        for step in range(300):
            free = PAGES - len(held)
            if free and (not held or rng.random() < 0.55):
                got = rg.alloc.alloc(rng.randint(1, min(free, 5)))
                held += got.tolist()
            else:
                rng.shuffle(held)
                n = rng.randint(1, len(held))
                out, held = held[:n], held[n:]
                rg.alloc._release_page_ids(torch.tensor(out, dtype=torch.int64))
            assert rg.unmapped_rows() == [], f"step {step}"
            with rg.store.lock:
                rg.store.trim_locked(keep=0)
        rg.policy.flush()
        assert rg.follower.held().tolist() == sorted(held) and rg.follower.divergences == 0
    finally:
        rg.close()
