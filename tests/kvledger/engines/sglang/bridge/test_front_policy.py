"""kvledger.engines.sglang.bridge.front_policy on a stand-in free list (no sglang): the budget, the
cover of an allocation past the pins, idle replays, and the rule that every row handed out
is on mapped pages when SGLang's method returns. The same against SGLang's own allocator:
test_bridge.py."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
import torch

from kvledger.engines.sglang.bridge.front_policy import IDLE_FLUSH_S
from tests.kvledger.engines.sglang.bridge.fakes import LateReader, PolicyRig

PAGES = 24


@pytest.fixture
def r() -> Iterator[PolicyRig]:
    rg = PolicyRig(pages=PAGES, max_spare_pages=1)
    yield rg
    rg.close()


def test_start_pins_the_mapped_front_and_says_so(r: PolicyRig) -> None:
    state = r.policy.debug_state()
    assert state["budget_reason"] == "pin: the mapped front"
    assert state["front"] == list(range(1, PAGES + 1))  # SGLang's whole list, as read
    assert state["safe_until"] <= state["net"] + PAGES


def test_the_next_replay_is_due_at_three_quarters_of_the_pinned_rows(r: PolicyRig) -> None:
    """Every other row of 2..20 given back, each on a page still in use: the ten rows at the
    front are pinned, none touches a page not in use (which would set an earlier replay),
    and the soft budget is 3/4 of them: the 7th row taken replays nothing, the 8th replays."""
    r.alloc.alloc(PAGES)
    r.policy.flush()
    back = list(range(2, 21, 2))
    r.alloc._release_page_ids(torch.tensor(back, dtype=torch.int64))
    r.policy.flush()
    state = r.policy.debug_state()
    assert state["front"] == back and state["budget_reason"] == "pin: the mapped front"
    base = state["replayed_net"]
    assert state["safe_until"] - base == 10
    assert state["soft_until"] - base == 10 * 3 // 4
    flushes = r.policy.flushes
    r.alloc.alloc(7)  # up to the soft budget: recorded only
    assert r.policy.flushes == flushes and len(r.policy.journal) == 1
    r.alloc.alloc(1)  # past it: this allocation replays
    assert r.policy.flushes == flushes + 1 and len(r.policy.journal) == 0
    assert r.follower.held().tolist() == r.alloc.held()


def test_an_allocation_past_the_pins_is_covered_before_it_returns() -> None:
    """Its ids not read yet (a CUDA read in flight), an allocation past the pinned rows has
    the next rows of the front last read mapped and pinned before SGLang's method returns,
    without waiting for the read."""
    rg = PolicyRig(pages=PAGES, reader=LateReader(), max_spare_pages=1)
    try:
        safe = rg.policy.safe_until
        got = rg.alloc.alloc(safe + 3)  # past the pinned rows
        assert rg.follower.held_rows == 0  # not replayed: the read has not landed
        assert rg.unmapped_rows() == []  # ... yet its rows are mapped
        assert set(rg.follower.pages_of(got.tolist())) <= set(rg.store.policy.pinned)
        assert rg.policy.forced == 0 and rg.policy.reader.waits == 0
        assert rg.follower.waited >= 1  # mapped on the allocating thread
        assert rg.policy.debug_state()["budget_reason"].startswith("cover")
        rg.policy.flush()  # waits for the read
        assert rg.follower.held().tolist() == rg.alloc.held()
    finally:
        rg.close()


def test_the_idle_replay_waits_for_the_journal_to_be_left_alone(r: PolicyRig) -> None:
    r.without_budget_replays()
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
    rg = PolicyRig(pages=PAGES, reader=reader, max_spare_pages=spares, handle_pool_pages=0)
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
                rg.store.policy.trim_locked(keep=0)
        rg.policy.flush()
        assert rg.follower.held().tolist() == sorted(held) and rg.follower.divergences == 0
    finally:
        rg.close()
