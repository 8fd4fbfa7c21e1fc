"""accounting.snapfile.checks: figures the first line can recompute are recomputed, not believed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accounting.buffers import Owner
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.relations import check_account
from accounting.rows import AccountRow
from accounting.snapfile.checks import account_may_break
from accounting.snapfile.format import Refused
from tests.accounting.snapfile.files import (
    copy_of,
    file_bytes,
    load_s,
    refused,
    rows_refused,
    with_snapshot,
)


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


# -- lies a trusted writer could tell with every sum intact: issue 43 finding 5 -------------------
GiB = 1 << 30


def _nvml(parts: dict, **changes) -> dict:
    from accounting.gpu_parts import PART_NAMES
    from accounting.reconcile import result

    entry = result(
        "nvml",
        ledger_bytes=0,
        device_bytes=0,
        basis="device",
        detail={},  # no used_bytes: the sum of the parts was not checked
        parts={**dict.fromkeys(PART_NAMES, 0), **parts},
        total_bytes=80 * GiB,
    )
    return {**entry, **changes}


@pytest.mark.parametrize(
    "entry, relation",
    [
        (_nvml({"weights": 500 * GiB}), "every GPU part within the device's total"),
        (_nvml({"unattributed": -(1 << 40)}), "every GPU part within the device's total"),
        (_nvml({}, device_bytes=1 << 40), "|unattributed_bytes| <= device total"),
        (_nvml({}, ledger_bytes=1 << 40), "|unattributed_bytes| <= device total"),
        (
            _nvml({"weights": GiB}, detail={}, total_bytes=None),
            "GPU parts held against NVML device used or the device total",
        ),
    ],
)
def test_truth_figures_past_the_devices_total_are_flagged_never_silent(published, entry, relation):
    """500 GiB of weights on an 80 GiB card with no used_bytes, or unattributed bytes of
    +-1 TiB, were exported with kvledger_relation_violations 0. The relation is recomputed:
    unlisted, the file is refused; listed, the figures go out with their violation."""
    e = refused(with_snapshot(published, reconciliation=[entry]))
    assert e.reason == "schema" and f"{relation}; not listed" in e.detail, e.detail
    from accounting.snapfile.summary import Reconciliation
    from accounting.snapshot import parts_violations

    found = parts_violations(Reconciliation.of(entry).to_dict())
    assert relation in {v.relation for v in found}
    head = load_s(with_snapshot(published, reconciliation=[entry], violations=found))
    assert set(found) <= set(head.summary.violations)


def _vmm(s: dict, **figures) -> None:
    i = s["accounts"]["owner"].index("vmm")
    for name, value in figures.items():
        s["accounts"][name][i] = value


@pytest.mark.parametrize(
    "figures, needle",
    [
        (  # handle_pages 0 next to 6 MiB physical (mapped 0 too: no relation of its own breaks)
            {"handle_pages": 0, "mapped_pages": 0},
            "physical_bytes=6291456 mapped_bytes=6291456, but its accounts hold 0 bytes of "
            "handle pages and 0 mapped",
        ),
        (  # 2 pages of 2 MiB per buffer: 6 MiB is no whole number of buffers of them
            {"handle_pages": 2},
            "not the same number of buffers times its account's 4194304 bytes",
        ),
        (  # 4 pages per buffer: more than the family's 6 MiB hold
            {"handle_pages": 4, "mapped_pages": 4},
            "less than its accounts' handle and mapped pages hold once",
        ),
    ],
)
def test_a_vmm_familys_bytes_must_come_from_its_accounts_pages(published, figures, needle):
    envelope, rows = copy_of(published)
    _vmm(envelope["snapshot"], **figures)
    e = refused(file_bytes(envelope, rows))
    assert e.reason == "schema" and e.detail.startswith("families swa_kv/vmm: "), e.detail
    assert needle in e.detail, e.detail


def test_a_vmm_family_of_several_accounts_is_held_to_their_pages_once(published):
    """Two accounts of one family (a draft pool beside the main one, as the ledger allows):
    their bytes at least each account's pages once; a family with pages but no bytes, or
    bytes but no pages, is refused."""
    from accounting.snapfile.checks import handle_pages_match

    accounts: dict[str, list[Any]] = {
        "family": ["swa_kv", "swa_kv"],
        "owner": ["vmm", "vmm"],
        "page_bytes": [4096, 4096],
        "handle_pages": [3, 1],
        "mapped_pages": [2, 1],
    }

    def family(physical: int, mapped: int) -> dict:
        return {
            "family": ["swa_kv"],
            "owner": ["vmm"],
            "physical_bytes": [physical],
            "mapped_bytes": [mapped],
        }

    handle_pages_match(family(3 * 3 * 4096 + 4096, 3 * 2 * 4096 + 4096), accounts)  # 3 + 1 buffers
    for physical, mapped in ((3 * 4096, 3 * 4096), (4 * 4096, 2 * 4096)):
        with pytest.raises(Refused, match="less than its accounts' handle and mapped pages"):
            handle_pages_match(family(physical, mapped), accounts)
    none = {**accounts, "handle_pages": [0, 0], "mapped_pages": [0, 0]}
    handle_pages_match(family(0, 0), none)
    with pytest.raises(Refused, match="but its accounts hold 0 bytes of handle pages"):
        handle_pages_match(family(4096, 0), none)


def _engine(*requests, **changes) -> dict:
    from accounting.engine_state import RequestHeld, engine_state

    reqs = [RequestHeld(f"r{i}", 1, 1.0, b, by) for i, (b, by) in enumerate(requests)]
    return {**engine_state(holders_from="T", requests=reqs).to_dict(), **changes}


@pytest.mark.parametrize(
    "state, needle",
    [
        (
            _engine((1000, {"vram": 1000})),
            "engine.requests[0]: bytes_by_family names 'vram', not a",
        ),
        (  # 10^9 running requests (the histogram made to agree) in 2,143 slots
            _engine(running_requests=10**9, request_bytes_counts=[10**9] + [0] * 9),
            "running_requests=1000000000, more than the 2143 slots of every family together",
        ),
    ],
)
def test_engine_figures_the_snapshot_cannot_hold_are_refused(published, state, needle):
    e = refused(with_snapshot(published, engine=state))
    assert e.reason == "schema" and needle in e.detail, e.detail


@pytest.mark.parametrize("case", ["pib", "family"])
def test_a_request_claiming_more_than_is_occupied_is_flagged_never_silent(published, case):
    """A request of 1 PiB (or of more bytes of a family than the family can hold) went out as
    its footprint with no violation. Recomputed: unlisted, the file is refused; listed, the
    footprint goes out with its violation (kvledger_relation_violations)."""
    from accounting.engine_state import EngineState, request_violations
    from accounting.snapfile.head import buffer_map

    tensor: dict[str, int] = {}
    for row in load_s(with_snapshot(published)).summary.families:
        tensor[row.family] = tensor.get(row.family, 0) + row.figures.tensor_bytes
    if case == "pib":  # 1 PiB on a pool of a few MB
        state, relation = _engine((10**15, {})), "request bytes <= tensor_bytes"
    else:
        over = tensor["c4_kv"] + 1
        state = _engine((over, {"c4_kv": over}))
        relation = "request bytes_by_family <= the family's tensor_bytes"
    e = refused(with_snapshot(published, engine=state))
    assert e.reason == "schema" and f"breaks {relation}" in e.detail, e.detail
    found = request_violations(EngineState.from_dict(state), tensor)
    assert len(found) == 1 and found[0].relation == relation, found
    head = load_s(with_snapshot(published, engine=state, violations=found))
    assert set(found) <= set(head.summary.violations)
    assert set(found) <= set(buffer_map(head).violations)  # the rows bear the first line out
