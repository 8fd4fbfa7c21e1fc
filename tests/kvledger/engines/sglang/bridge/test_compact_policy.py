"""The production compaction policy (kvledger.engines.sglang.bridge.compact_policy) on the fakes' rig:
when it is due, what it passes on, and the switch (no sglang)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from allocator.states import PageState
from kvledger.engines.sglang.bridge.compact_policy import MAX_MOVES_PER_STEP, CompactionPolicy
from tests.kvledger.engines.sglang.bridge.fakes import PolicyRig


def _bridge(rig: PolicyRig, calls: list[int]) -> Any:
    def compact(max_moves: int) -> int:
        calls.append(max_moves)
        return 3

    return types.SimpleNamespace(
        active=True, follower=rig.follower, store=rig.store, policy=rig.policy, compact=compact
    )


def _mapped(rig: PolicyRig) -> int:
    return rig.store.state.count(PageState.MAPPED)


def test_due_only_past_the_packing_bound_and_then_within_the_budget() -> None:
    rig = PolicyRig(pages=64, max_spare_pages=1, batch=1)
    try:
        calls: list[int] = []
        br = _bridge(rig, calls)
        policy = CompactionPolicy()
        held = [rig.alloc.alloc(1) for _ in range(40)]
        assert policy.step(br) == 0 and calls == []  # packed: nothing to do
        for t in held[::2]:  # every other row back: the pages stay in use, half empty
            rig.alloc._release_page_ids(t)
        rig.policy.flush(wait=True)
        assert policy.excess(br) > 0
        assert policy.step(br) == 3 and calls == [MAX_MOVES_PER_STEP]
        assert policy.stats() == {
            "compaction_steps": 2,
            "compaction_runs": 1,
            "compaction_rows_moved": 3,
        }
        off = CompactionPolicy(enabled=False)
        assert off.step(br) == 0 and calls == [MAX_MOVES_PER_STEP]
        assert "off" in off.describe()
    finally:
        rig.close()


def test_the_rows_taken_since_the_last_replay_count_without_a_replay() -> None:
    rig = PolicyRig(pages=64, max_spare_pages=1)
    try:
        rig.without_budget_replays()
        br = _bridge(rig, [])
        policy = CompactionPolicy()
        f, store = rig.follower, rig.store

        def bound(held: int) -> int:
            packed = -(-((held + f.first_row) * f.row_bytes) // store.page_bytes)
            return packed + store.policy.max_spare_pages + 1

        def to_come() -> int:  # the spares the mapper may still map ahead
            return max(0, store.policy.max_spare_pages - len(store.spares))

        taken = rig.alloc.alloc(20)  # journaled, not replayed: the follower has not seen them
        assert f.held_rows == 0
        assert policy.excess(br) == _mapped(rig) + to_come() - bound(20)
        rig.alloc._release_page_ids(taken)  # given back, still not replayed
        assert f.held_rows == 0
        assert policy.excess(br) == _mapped(rig) + to_come() - bound(0)
    finally:
        rig.close()


def test_due_when_the_spares_still_to_map_would_take_it_over_the_bound() -> None:
    """Within the bound now, with no spare mapped: the mapper's maps ahead would take it over
    before the next step, so the step compacts now."""
    rig = PolicyRig(pages=64, max_spare_pages=2, batch=1)
    try:
        calls: list[int] = []
        br = _bridge(rig, calls)
        policy = CompactionPolicy()
        f, store = rig.follower, rig.store
        held = [rig.alloc.alloc(1) for _ in range(40)]  # rows 1..40, packed
        for t in held[5:8]:  # rows 6..8 back: the pages of rows 5 and 9 stay in use around
            # the hole, two more than the 37 rows need packed
            rig.alloc._release_page_ids(t)
        rig.policy.flush(wait=True)
        with store.lock:
            while store.spares:  # no spare mapped: only the pages in use
                store.unmap_spare_locked(next(iter(store.spares)))
        packed = -(-((f.held_rows + f.first_row) * f.row_bytes) // store.page_bytes)
        bound = packed + store.policy.max_spare_pages + 1
        assert store.in_use.count(1) == packed + 2 == _mapped(rig)
        assert _mapped(rig) <= bound < _mapped(rig) + store.policy.max_spare_pages
        assert policy.excess(br) == _mapped(rig) + store.policy.max_spare_pages - bound > 0
        assert policy.step(br) == 3 and calls == [MAX_MOVES_PER_STEP]
    finally:
        rig.close()


@pytest.mark.parametrize(("field", "bad"), [("excess_pages", -1), ("max_moves", 0)])
def test_bad_settings_are_refused_naming_the_value(field: str, bad: int) -> None:
    with pytest.raises(ValueError, match=f"{field}={bad}"):
        CompactionPolicy(**{field: bad})  # type: ignore[arg-type]


def test_from_env_reads_the_switch_and_the_slack() -> None:
    assert CompactionPolicy.from_env({}).enabled
    assert CompactionPolicy.from_env({}).excess_pages == 2  # switches.DEFAULT_COMPACT_SLACK
    assert CompactionPolicy.from_env({"KVLEDGER_SGLANG_DSV4_COMPACT_SLACK": "0"}).excess_pages == 0
    assert not CompactionPolicy.from_env({"KVLEDGER_SGLANG_DSV4_COMPACT": "0"}).enabled
    assert CompactionPolicy.from_env({"KVLEDGER_SGLANG_DSV4_COMPACT_SLACK": "3"}).excess_pages == 3
    with pytest.raises(ValueError, match="KVLEDGER_SGLANG_DSV4_COMPACT_SLACK='-3'"):
        CompactionPolicy.from_env({"KVLEDGER_SGLANG_DSV4_COMPACT_SLACK": "-3"})


def test_a_slack_waits_until_the_excess_passes_it() -> None:
    """The same fragmented rig as the first test: not due while the excess is within the
    slack, due once it is past it."""
    rig = PolicyRig(pages=64, max_spare_pages=1, batch=1)
    try:
        calls: list[int] = []
        br = _bridge(rig, calls)
        held = [rig.alloc.alloc(1) for _ in range(40)]
        for t in held[::2]:
            rig.alloc._release_page_ids(t)
        rig.policy.flush(wait=True)
        excess = CompactionPolicy().excess(br)
        assert excess > 0
        within = CompactionPolicy(excess_pages=excess)
        assert within.step(br) == 0 and calls == [] and within.runs == 0
        past = CompactionPolicy(excess_pages=excess - 1)
        assert past.step(br) == 3 and calls == [MAX_MOVES_PER_STEP]
        assert "more than " + str(excess - 1) in past.describe()
    finally:
        rig.close()
