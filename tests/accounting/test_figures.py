"""The one table of figures."""

from __future__ import annotations

import pytest

from accounting.figures import FIGURE_NAMES, FIGURES, figure


def test_names_are_unique_and_units_known() -> None:
    assert len(FIGURE_NAMES) == len(set(FIGURE_NAMES)) == len(FIGURES)
    assert {f.unit for f in FIGURES} <= {"bytes", "slots"}
    for f in FIGURES:
        assert f.meaning and f.relation
        assert f.name.endswith("_" + f.unit), f"{f.name} should carry its unit"


def test_the_four_figures_of_design_md_are_there() -> None:
    for name in ("tensor_bytes", "reserved_bytes", "physical_bytes", "occupied_slots"):
        assert figure(name).name == name
    assert figure("occupied_slots").per_account and not figure("physical_bytes").per_account


def test_unknown_figure_names_the_choices() -> None:
    with pytest.raises(KeyError, match="tensor_bytes"):
        figure("allocated_bytes")
