"""accounting.snapfile.checks: figures the first line can recompute are recomputed, not believed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accounting.buffers import Owner
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.relations import check_account
from accounting.rows import AccountRow
from accounting.snapfile.checks import account_may_break
from tests.accounting.snapfile.files import copy_of, file_bytes, load_s, refused, rows_refused


def _append_row(columns: dict, i: int) -> None:
    """A copy of row `i` appended to every column."""
    for column in columns.values():
        column.append(column[i])


def _pop_row(columns: dict) -> None:
    for column in columns.values():
        column.pop()


def _partial_page(s: dict) -> None:
    """A VMM family's physical bytes one byte off a whole page (the totals made to match)."""
    fam = s["families"]
    fam["physical_bytes"][fam["owner"].index("vmm")] += 1
    s["totals"]["physical_bytes"] += 1


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: s["totals"].update(physical_bytes=80 << 30), "totals: physical_bytes"),
        (lambda s: s["families"]["occupied_slots"].__setitem__(0, 10**9), "sum to"),
        (lambda s: _pop_row(s["families"]), "no row for the accounts"),
        (_partial_page, "is not a whole number of pages of"),
        (lambda s: _append_row(s["families"], 0), "listed twice"),
        (lambda s: _append_row(s["accounts"], 0), "listed twice"),
        (
            lambda s: s["accounts"]["mapped_pages"].__setitem__(
                0, s["accounts"]["handle_pages"][0] + 1
            ),
            "breaks mapped_pages <= handle_pages; not listed",
        ),
        (
            lambda s: s["accounts"]["slot_bytes"].__setitem__(
                0, s["accounts"]["slot_bytes"][0] + 1
            ),
            "(occupied_slots x slot_bytes) sum to",
        ),
        (
            lambda s: s["accounts"]["held_unattributed"].__setitem__(
                0, s["accounts"]["held_unattributed"][0] + 1
            ),
            "breaks tree_protected + tree_evictable + request_only + unattributed == "
            "occupied_slots; not listed",
        ),
        (
            lambda s: s["accounts"]["occupied_slots"].__setitem__(
                0, s["accounts"]["capacity_slots"][0] + 1
            ),
            "sum to",  # the family's slots no longer match: refused before the violations
        ),
    ],
)
def test_figures_the_first_line_can_recompute_are_not_trusted(published, change, needle):
    envelope, rows = copy_of(published)
    change(envelope["snapshot"])
    e = refused(file_bytes(envelope, rows))
    assert e.reason == "schema" and needle in e.detail, e.detail


def test_a_family_whose_sums_break_a_relation_must_list_a_violation(published):
    envelope, rows = copy_of(published)
    snap = envelope["snapshot"]
    fam = snap["families"]
    i = fam["owner"].index("vmm")
    grown = fam["reserved_bytes"][i] + 1 - fam["tensor_bytes"][i]
    fam["tensor_bytes"][i] += grown
    snap["totals"]["tensor_bytes"] += grown
    e = refused(file_bytes(envelope, rows))
    assert "no violation of tensor_bytes <= reserved_bytes listed" in e.detail
    snap["violations"].append(
        {"subject": "p/x", "relation": "tensor_bytes <= reserved_bytes", "detail": "d"}
    )
    head = load_s(file_bytes(envelope, rows))
    assert len(head.summary.violations) == 1  # exported as listed
    # ... and the rows, read later, do not bear the first line out: that buffer map only.
    assert "the rows sum to" in rows_refused(file_bytes(envelope, rows)).detail


def test_a_vmm_family_whose_mapped_bytes_are_not_whole_pages_is_refused(published):
    """Mapped bytes are held to whole pages as physical bytes are: one byte short of a page,
    every other relation still holding (mapped <= physical, occupied <= mapped, the totals
    summed), and the first line is refused naming mapped_bytes."""
    envelope, rows = copy_of(published)
    snap = envelope["snapshot"]
    fam = snap["families"]
    i = fam["owner"].index("vmm")
    fam["mapped_bytes"][i] -= 1
    snap["totals"]["mapped_bytes"] -= 1
    e = refused(file_bytes(envelope, rows))
    mapped = fam["mapped_bytes"][i]
    assert e.reason == "schema", e
    assert e.detail.startswith(
        f"families {fam['family'][i]}/vmm: mapped_bytes={mapped} is not a whole number of pages"
    ), e.detail


@pytest.mark.parametrize(
    "owner, lo, hi",
    [("runtime", "occupied_bytes", "tensor_bytes"), ("vmm", "mapped_bytes", "physical_bytes")],
)
def test_each_summed_relation_of_a_family_is_told_from_its_columns(published, owner, lo, hi):
    """A family whose sums break occupied <= tensor (runtime) or mapped <= physical (VMM)
    must list the violation: found by the pass over the family columns."""
    envelope, rows = copy_of(published)
    snap = envelope["snapshot"]
    fam = snap["families"]
    i = next(
        j
        for j, (o, v) in enumerate(zip(fam["owner"], fam[lo], strict=True))
        if o == owner and v > 0
    )
    fam[hi][i] = 0  # whole pages, and below `lo`
    snap["totals"][hi] = sum(fam[hi])
    e = refused(file_bytes(envelope, rows))
    assert f"no violation of {lo} <= {hi} listed" in e.detail, e.detail


@given(
    st.fixed_dictionaries(
        {
            k: st.integers(0, 20)
            for k in (
                "handle_pages",
                "mapped_pages",
                "occupied_slots",
                "capacity_slots",
                "held_request_only",
                "held_unattributed",
            )
        }
    )
)
def test_account_may_break_knows_every_relation_check_account_checks(figs):
    """load asks check_account only when account_may_break says it could find something."""
    row = AccountRow(
        key="p/f",
        family="f",
        pool="p",
        owner=Owner.VMM,
        page_bytes=4096,
        peak_occupied_slots=0,
        peak_handle_pages=0,
        pages_mapped_total=0,
        pages_unmapped_total=0,
        map_seconds_total=0.0,
        unmap_seconds_total=0.0,
        map_calls=0,
        map_bucket_counts=(0,) * (len(MAP_SECONDS_BUCKETS) + 1),
        **figs,
    )
    assert bool(check_account(row)) == account_may_break(row)
