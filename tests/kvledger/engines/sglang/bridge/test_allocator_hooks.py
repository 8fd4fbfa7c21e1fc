"""kvledger.engines.sglang.bridge.allocator_hooks on a stand-in free list (no sglang): what is
shadowed and restored, what each wrapper records, when it asks the policy for a replay."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvledger.engines.sglang.bridge.allocator_hooks import AllocatorHooks
from kvledger.engines.sglang.bridge.compat import WRAPPED_METHODS
from kvledger.engines.sglang.bridge.front_policy import NO_ROWS, FrontPolicy
from kvledger.engines.sglang.bridge.journal import MERGE, RELEASE, TAKE
from tests.kvledger.engines.sglang.bridge.fakes import FreeList, PolicyRig

PAGES = 16


@pytest.fixture
def r() -> Iterator[PolicyRig]:
    rg = PolicyRig(pages=PAGES)
    rg.without_budget_replays()
    yield rg
    rg.close()


def test_install_shadows_the_six_methods_on_the_instance_and_remove_restores_them(
    r: PolicyRig,
) -> None:
    r.hooks.install()  # installed by the rig already: idempotent
    assert set(vars(r.alloc)) >= set(WRAPPED_METHODS)
    assert not set(vars(FreeList(2))) & set(WRAPPED_METHODS)  # the class is untouched
    taken = r.alloc.alloc_decode(2)
    assert len(r.policy.journal) == 1 and r.follower.held_rows == 0  # recorded, not replayed
    r.hooks.remove()
    r.hooks.remove()  # idempotent
    assert not set(vars(r.alloc)) & set(WRAPPED_METHODS)
    assert len(r.policy.journal) == 0  # remove replays what is left
    assert r.follower.held().tolist() == taken.tolist() == r.alloc.held()
    r.alloc.alloc_decode(1)  # SGLang's own method again: nothing recorded
    assert len(r.policy.journal) == 0


def test_the_context_manager_installs_and_removes(r: PolicyRig) -> None:
    r.hooks.remove()
    with r.hooks as hooks:
        assert hooks.installed and "alloc" in vars(r.alloc)
    assert not r.hooks.installed and "alloc" not in vars(r.alloc)


def test_each_wrapper_records_what_sglang_did(r: PolicyRig) -> None:
    raw = r.policy.journal.raw
    assert r.alloc.alloc_decode(0) is not None and raw == []  # no page taken: nothing
    fp0 = r.alloc.free_pages
    out = r.alloc.alloc_extend(3)
    assert raw[-1][0] == TAKE and raw[-1][1] is fp0 and raw[-1][2:] == (3, 3)
    r.alloc._release_page_ids(out[:1])
    assert raw[-1][0] == RELEASE and raw[-1][2] == 2
    assert r.policy.journal.widest == 3
    assert r.policy.journal.calls == 6  # three calls, each begun and ended


def test_a_full_batch_replays_on_the_allocating_thread() -> None:
    rg = PolicyRig(pages=PAGES, batch=2)
    try:
        rg.without_budget_replays()
        rg.alloc.alloc(1)
        assert rg.follower.held_rows == 0
        rg.alloc.alloc(1)  # the second recorded call: a replay
        assert len(rg.policy.journal) == 0 and rg.follower.held().tolist() == rg.alloc.held()
    finally:
        rg.close()


def test_a_merge_voids_the_budget_and_the_next_allocation_replays() -> None:
    rg = PolicyRig(pages=PAGES, need_sort=True)
    try:
        rg.without_budget_replays()
        everything = rg.alloc.alloc(PAGES)
        rg.alloc._release_page_ids(everything[:4])  # staged: not in front of the list
        assert rg.policy.journal.net == PAGES
        rg.alloc.merge_and_sort_free()  # the staged pages sorted into the list
        assert rg.policy.journal.raw[-1] == (MERGE, PAGES)
        state = rg.policy.debug_state()
        assert state["safe_until"] == state["soft_until"] == NO_ROWS
        assert state["budget_reason"].startswith("merge")
        got = rg.alloc.alloc(2)  # past the void budget: replayed before it returns
        assert len(rg.policy.journal) == 0
        assert rg.follower.held().tolist() == rg.alloc.held()
        assert set(got.tolist()) <= set(rg.follower.held().tolist())
        assert rg.policy.debug_state()["budget_reason"].startswith("pin")
    finally:
        rg.close()


def test_clear_re_reads_the_allocator(r: PolicyRig) -> None:
    r.alloc.alloc(5)
    r.policy.flush()
    assert r.follower.held_rows == 5
    r.alloc.clear()
    assert r.follower.held_rows == 0 and r.policy.resyncs == 1 and len(r.policy.journal) == 0


def test_refuses_an_allocator_it_cannot_wrap(r: PolicyRig) -> None:
    class Partial:
        free_pages = torch.zeros(0)

        def alloc(self, n: int) -> None:
            return None

    with pytest.raises(TypeError, match=r"Partial lacks alloc_extend, .*expected SGLang"):
        AllocatorHooks(Partial(), r.policy)
    with pytest.raises(RuntimeError, match="already overrides alloc"):
        AllocatorHooks(r.alloc, r.policy)  # the rig's hooks are installed on it
    other = FreeList(PAGES)
    with pytest.raises(ValueError, match="expected the allocator being hooked"):
        AllocatorHooks(other, r.policy)
    with pytest.raises(ValueError, match="batch"):
        AllocatorHooks(other, FrontPolicy(other, r.follower), batch=0)
