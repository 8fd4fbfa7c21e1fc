"""Transaction: undo steps run latest first unless committed; a failing undo stops nothing."""

from __future__ import annotations

import pytest

from allocator.transaction import Transaction


def test_leaving_without_commit_undoes_every_step_latest_first() -> None:
    undone: list[int] = []
    with pytest.raises(KeyError), Transaction() as t:
        for step in range(3):
            t.append(undone.append, step)
        raise KeyError("the work failed")
    assert undone == [2, 1, 0]


def test_a_return_before_commit_undoes_too_and_commit_keeps_everything() -> None:
    undone: list[str] = []

    def work(commit: bool) -> None:
        with Transaction() as t:
            t.append(undone.append, "a")
            if not commit:
                return
            t.commit()

    work(commit=True)
    assert undone == []
    work(commit=False)
    assert undone == ["a"]


def test_a_failing_undo_is_kept_and_the_others_still_run() -> None:
    undone: list[str] = []

    def broken() -> None:
        raise OSError("undo failed")

    t = Transaction()
    with pytest.raises(ValueError, match="the work"), t:
        t.append(undone.append, "first")
        t.append(broken)
        t.append(undone.append, "last")
        raise ValueError("the work failed")  # this error, not the undo's, comes out
    assert undone == ["last", "first"]
    assert [str(e) for e in t.undo_errors] == ["undo failed"]
    t.rollback()  # nothing left to undo
    assert undone == ["last", "first"]
