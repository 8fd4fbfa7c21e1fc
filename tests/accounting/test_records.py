"""accounting.records: records built without __init__ are the records __init__ builds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from accounting.figures import Held
from accounting.records import record_maker


def test_a_record_equals_hashes_and_prints_as_one_built_by_init():
    make = record_maker(Held)
    built, made = Held(1, 2, 3, 4), make(1, 2, 3, 4)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert made.total() == 10 and made != make(1, 2, 3, 5)
    with pytest.raises(AttributeError):
        made.tree_protected = 9  # type: ignore[misc]  # still frozen


def test_every_field_must_be_given():
    with pytest.raises(ValueError):
        record_maker(Held)(1, 2, 3)


def test_a_class_whose_init_does_more_is_refused():
    @dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError("x < 0")

    with pytest.raises(TypeError, match="Checked has __post_init__"):
        record_maker(Checked)
    with pytest.raises(TypeError, match="not a dataclass"):
        record_maker(int)
