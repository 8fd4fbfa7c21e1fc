"""The one table of figures."""

from __future__ import annotations

import pytest

from accounting.events import PoolEvent
from accounting.figures import FIGURE_NAMES, FIGURES, figure
from accounting.ledger import Ledger
from tests.accounting.helpers import runtime_specs, vmm_account


def test_names_are_unique_and_units_known() -> None:
    assert len(FIGURE_NAMES) == len(set(FIGURE_NAMES)) == len(FIGURES)
    assert {f.unit for f in FIGURES} <= {"bytes", "slots"}
    for f in FIGURES:
        assert f.meaning and f.relation
        assert f.name.endswith("_" + f.unit), f"{f.name} should carry its unit"


def test_the_four_figures_of_a_known_pool_are_the_hand_computed_numbers() -> None:
    """A pool whose figures are worked out by hand (docs/background.md#the-four-figures):
    a VMM family of 3 layer buffers (4096 slots of 584 B, 4 pages of 2 MiB reserved each,
    3 page ids with handles, 2 mapped, 1000 slots occupied) and a runtime family of 2
    tensors (100 rows of 64 B, 30 occupied)."""
    ledger = Ledger({"model_name": "m"})
    swa = vmm_account(ledger, layers=3, slot_bytes=584, capacity=4096, reserved_pages=4)
    c4 = ledger.add_account(runtime_specs("c4", "c4_kv", 2, rows=100, row_bytes=64))
    swa.on_pool_event(PoolEvent.HANDLES_CREATED, 3)
    swa.on_pool_event(PoolEvent.PAGES_MAPPED, 2, 0.001)
    swa.on_slots(1000, 1200)
    c4.occupy(30)
    snap = ledger.snapshot(reconcile=False)
    by_family = {k[0]: v for k, v in snap.rollup("family").items()}
    assert by_family["swa_kv"] == {
        "tensor_bytes": 3 * 2_392_064,  # 4096 x 584 per layer
        "reserved_bytes": 3 * 8_388_608,  # 4 x 2 MiB per layer
        "physical_bytes": 3 * 6_291_456,  # 3 handles x 2 MiB per layer, mapped or not
        "mapped_bytes": 3 * 4_194_304,  # 2 pages x 2 MiB per layer
        "occupied_bytes": 3 * 584_000,  # 1000 x 584 per layer
        "occupied_slots": 1000,  # one index space for the 3 layers: not 3000
        "capacity_slots": 4096,
    }
    assert by_family["c4_kv"] == {
        "tensor_bytes": 12_800,  # 2 x 100 x 64
        "reserved_bytes": 12_800,  # an ordinary tensor: its storage
        "physical_bytes": 12_800,
        "mapped_bytes": 12_800,
        "occupied_bytes": 3_840,  # 2 x 30 x 64
        "occupied_slots": 30,
        "capacity_slots": 100,
    }
    totals = {name: snap.total(name) for name in FIGURE_NAMES}
    assert totals == {
        "tensor_bytes": 7_188_992,
        "reserved_bytes": 25_178_624,
        "physical_bytes": 18_887_168,
        "mapped_bytes": 12_595_712,
        "occupied_bytes": 1_755_840,
        "occupied_slots": 1030,
        "capacity_slots": 4196,
    }
    assert snap.violations == ()
    assert figure("occupied_slots").per_account and not figure("physical_bytes").per_account


def test_unknown_figure_names_the_choices() -> None:
    with pytest.raises(KeyError, match="tensor_bytes"):
        figure("allocated_bytes")


def test_the_table_is_the_fields_of_figures_and_figures_add_up() -> None:
    import dataclasses

    from accounting.figures import FIGURE_NAMES, Figures

    assert tuple(f.name for f in dataclasses.fields(Figures)) == FIGURE_NAMES
    assert [f.name for f in FIGURES] == list(FIGURE_NAMES)
    one = Figures.of({name: i + 1 for i, name in enumerate(FIGURE_NAMES)})
    assert one.values() == tuple(range(1, len(FIGURE_NAMES) + 1))
    assert one.to_dict() == {name: i + 1 for i, name in enumerate(FIGURE_NAMES)}
    assert Figures.sum([one, one]).physical_bytes == 2 * one.physical_bytes
    assert Figures.sum([]) == Figures(*(0,) * len(FIGURE_NAMES))
