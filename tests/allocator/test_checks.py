"""allocator.checks: counts refused naming the value and the floor."""

from __future__ import annotations

import pytest

from allocator.checks import check_count


def test_a_count_at_or_above_the_floor_is_returned() -> None:
    assert check_count("n", 0, 0) == 0
    assert check_count("n", 7, 1) == 7


@pytest.mark.parametrize("bad", [-1, 0, 1.0, True, "2", None])
def test_anything_else_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"^n={bad!r}, expected an int >= 1$".replace("(", r"\(")):
        check_count("n", bad, 1)
