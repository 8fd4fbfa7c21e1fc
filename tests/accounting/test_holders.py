# mypy: disable-error-code="attr-defined"
"""Holders (accounting.figures.Held): occupied slots split by who holds them, disjoint, adding
up to occupied_slots in the ledger, in a snapshot, and in a published file read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from accounting.figures import HOLDER_NAMES, HOLDER_RELATION, HOLDERS, Held
from accounting.ledger import Ledger, LedgerError
from accounting.snapfile.head import load
from accounting.snapfile.summary import summary_of
from accounting.snapfile.writer import Publisher
from tests.accounting.helpers import runtime_specs


def _ledger() -> tuple[Ledger, object]:
    ledger = Ledger({"model_name": "m"})
    acc = ledger.add_account(runtime_specs("p", "c4_kv", 3, rows=100, row_bytes=64))
    return ledger, acc


def test_the_table_names_four_disjoint_holders_in_precedence_order() -> None:
    assert HOLDER_NAMES == ("tree_protected", "tree_evictable", "request_only", "unattributed")
    assert all(h.meaning for h in HOLDERS)
    assert Held(1, 2, 3, 4).total() == 10
    assert Held(1, 2, 3, 4).times(3) == Held(3, 6, 9, 12)


def test_unread_holders_leave_every_occupied_slot_unattributed() -> None:
    ledger, acc = _ledger()
    acc.occupy(40)
    (row,) = ledger.snapshot().accounts
    assert row.held == Held(unattributed=40)
    assert row.slot_bytes == 3 * 64


def test_the_tree_takes_precedence_and_requests_hold_the_rest() -> None:
    ledger, acc = _ledger()
    acc.occupy(40)
    acc.set_holders(10, 25)
    snap = ledger.snapshot()
    (row,) = snap.accounts
    assert row.held == Held(10, 25, 5, 0)
    assert not snap.violations
    (fam,) = summary_of(snap).holders
    assert fam.slots == Held(10, 25, 5, 0)
    assert fam.bytes == Held(10, 25, 5, 0).times(3 * 64)
    assert fam.bytes.total() == summary_of(snap).families[0].figures.occupied_bytes
    acc.set_holders(0, 0)  # no tree: all of it held by requests
    assert ledger.snapshot().accounts[0].held == Held(request_only=40)
    acc.clear_holders()
    assert ledger.snapshot().accounts[0].held == Held(unattributed=40)


def test_a_tree_claiming_more_than_is_occupied_is_a_violation_not_clamped() -> None:
    ledger, acc = _ledger()
    acc.occupy(10)
    acc.set_holders(6, 6)
    snap = ledger.snapshot()
    (v,) = snap.violations
    assert v.relation == HOLDER_RELATION
    assert "tree_protected=6" in v.detail and "occupied_slots=10" in v.detail


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_bad_holder_values_are_refused_naming_them(bad) -> None:
    _, acc = _ledger()
    with pytest.raises(LedgerError, match="tree_evictable="):
        acc.set_holders(0, bad)
    with pytest.raises(LedgerError, match="evicted slots="):
        acc.count_evicted(bad)


def test_eviction_counters_and_a_probe_run_at_every_snapshot() -> None:
    ledger, acc = _ledger()
    seen = []

    def probe() -> None:
        seen.append(1)
        acc.set_holders(0, len(seen))

    ledger.add_probe(probe)
    acc.occupy(5)
    acc.count_evicted(7)
    acc.count_evicted(3, window=True)
    row = ledger.snapshot().accounts[0]
    assert row.held == Held(0, 1, 4, 0)
    assert (row.evicted_slots_total, row.window_evicted_slots_total) == (7, 3)
    assert ledger.snapshot().accounts[0].held == Held(0, 2, 3, 0)
    ledger.remove_probe(probe)
    ledger.snapshot()
    assert len(seen) == 2


def test_holders_travel_in_the_file_and_are_checked_on_read(tmp_path: Path) -> None:
    import time

    ledger, acc = _ledger()
    acc.occupy(40)
    acc.set_holders(10, 25)
    acc.count_evicted(8)
    with Publisher(ledger, tmp_path, interval=1, source="s") as pub:
        data = Path(pub.path).read_bytes()
    head = load(data, "s.json", time.time())
    (fam,) = head.summary.holders
    assert fam.slots == Held(10, 25, 5, 0)
    assert fam.evicted_slots_total == 8 and fam.evicted_bytes_total == 8 * 3 * 64
    assert head.summary.holders == summary_of(ledger.snapshot()).holders


def _published_with_engine(tmp_path: Path, state) -> bytes:
    ledger, acc = _ledger()
    acc.occupy(60)
    ledger.set_engine_state(lambda: state)
    with Publisher(ledger, tmp_path, interval=1, source="s") as pub:
        return Path(pub.path).read_bytes()


def test_the_engine_state_travels_capped_and_is_checked_on_read(tmp_path: Path) -> None:
    import json
    import time

    from accounting.engine_state import MAX_REQUESTS, RequestHeld, engine_state
    from accounting.snapfile.format import Refused

    # Footprints within what the ledger holds (c4_kv: 60 slots of 192 bytes occupied):
    # accounting.engine_state.request_violations.
    reqs = [RequestHeld(f"r{i}", i, 1.5, i * 192, {"c4_kv": i * 192}) for i in range(50)]
    state = engine_state(holders_from="T", notes=["no host tier"], requests=reqs)
    assert state.running_requests == 50 and len(state.requests) == MAX_REQUESTS
    assert state.requests[0].rid == "r49" and sum(state.request_bytes_counts) == 50
    data = _published_with_engine(tmp_path, state)
    got = load(data, "s.json", time.time()).summary.engine
    assert got == state
    head, rest = data.split(b"\n", 1)
    env = json.loads(head)
    env["snapshot"]["engine"]["request_bytes_counts"][0] += 1
    with pytest.raises(Refused, match="sum to 51, running_requests=50"):
        load(json.dumps(env).encode() + b"\n" + rest, "s.json", time.time())
    env["snapshot"]["engine"]["request_bytes_counts"][0] -= 1
    env["snapshot"]["engine"]["requests"][0]["bytes"] = -1
    with pytest.raises(Refused, match=r"requests\[0\]: bytes=-1"):
        load(json.dumps(env).encode() + b"\n" + rest, "s.json", time.time())
