"""The snapshot's `request_slots` part (accounting.request_slots): published by a real
ledger, read back by the exporter's loader, and refused, naming the value, wherever a file
says something it cannot hold."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from accounting.engine_state import MAX_REQUESTS, MAX_RID
from accounting.request_slots import (
    BUCKETS,
    REQUEST_SLOTS_BUCKETS,
    RequestSlots,
    clean_rid,
    request_slots,
)
from accounting.snapfile.format import parse
from accounting.snapfile.head import buffer_map
from accounting.snapfile.writer import Publisher
from tests.accounting.snapfile.files import load_s, refused, with_snapshot
from tests.ledgers import small_ledger

FAMILIES = ("c4_kv", "c4_attn_state")  # 64 and 32 slots in tests.ledgers.small_ledger


def _part(*requests: tuple[str, int, int], **changes) -> dict:
    part = request_slots(FAMILIES, [(rid, 10, (a, b)) for rid, a, b in requests]).to_dict()
    return {**part, **changes}


def test_the_builder_counts_every_request_and_lists_the_largest() -> None:
    running = [(f"r{i}", i, (i % 60, 1)) for i in range(50)]
    part = request_slots(FAMILIES, running)
    assert part.running_requests == 50
    kv, state = part.families
    assert (kv.family, kv.slots_sum, sum(kv.counts)) == (
        "c4_kv",
        sum(i % 60 for i in range(50)),
        50,
    )
    assert (state.slots_sum, state.counts[0]) == (50, 50)  # 1 slot each: the first bucket
    assert len(part.requests) == MAX_REQUESTS
    totals = [r.total for r in part.requests]
    assert totals == sorted(totals, reverse=True) and totals[0] == 50  # r49: 49 + 1
    with pytest.raises(ValueError, match="request 'x' has 1 figures, expected one per family"):
        request_slots(FAMILIES, [("x", 0, (1,))])


def test_request_ids_are_bounded_and_printable() -> None:
    assert clean_rid("a\nb\x1b[31m") == "a?b?[31m"
    assert clean_rid("x" * 1000) == "x" * MAX_RID
    (r,) = request_slots(FAMILIES, [("evil\r\n" + "y" * 500, 1, (1, 1))]).requests
    assert r.rid.startswith("evil??") and len(r.rid) == MAX_RID


def test_a_ledger_publishes_it_and_the_exporter_reads_it_back(tmp_path: Path) -> None:
    part = request_slots(FAMILIES, [("a", 40, (32, 2)), ("b", 70, (64, 2)), ("c", 3, (0, 0))])
    with small_ledger() as sl:
        sl.ledger.set_request_slots(lambda: part)
        with Publisher(sl.ledger, tmp_path, interval=1, source="s") as pub:
            data = Path(pub.path).read_bytes()
            envelope, _ = parse(data)
        sl.ledger.set_request_slots(None)
        assert sl.ledger.snapshot(reconcile=False).request_slots is None
        sl.free_all()
    assert envelope["snapshot"]["request_slots"] == part.to_dict()
    head = load_s(data)
    assert head.summary.request_slots == part
    assert buffer_map(head).request_slots == part
    assert RequestSlots.from_dict(json.loads(json.dumps(part.to_dict()))) == part


def test_a_snapshot_without_it_writes_no_key(published) -> None:
    envelope, _, snap = published
    assert "request_slots" not in envelope["snapshot"] and snap.request_slots is None
    assert load_s(with_snapshot(published)).summary.request_slots is None


GOOD = _part(("a", 32, 2), ("b", 64, 2))


def _family(i: int, **changes) -> dict:
    d = json.loads(json.dumps(GOOD))
    d["families"][i].update(changes)
    return d


def _request(i: int, **changes) -> dict:
    d = json.loads(json.dumps(GOOD))
    d["requests"][i].update(changes)
    return d


@pytest.mark.parametrize(
    "part, needle",
    [
        ([], "request_slots: expected an object, got list"),
        ({**GOOD, "running_requests": -1}, "running_requests=-1, expected an integer >= 0"),
        ({**GOOD, "running_requests": True}, "running_requests=True, expected an integer"),
        (_request(0, rid="a\nb"), "requests[0]: rid='a\\nb', expected a printable string"),
        (_request(0, rid="x" * (MAX_RID + 1)), f"of at most {MAX_RID} characters"),
        (_request(0, rid=7), "rid=7, expected a printable string"),
        (_request(0, slots_by_family={"vram": 1}), "slots_by_family names 'vram', not one of"),
        (_request(0, slots_by_family={"c4_kv": -3}), "slots_by_family: -3, expected non-negative"),
        (_request(0, slots_by_family={"c4_kv": 1.5}), "slots_by_family: 1.5, expected non-neg"),
        (_request(0, tokens=2**64), "tokens=1.8446744073709552e+19, expected an integer >= 0"),
        (_family(0, counts=[2]), f"counts=[2], expected {BUCKETS} non-negative integers"),
        (_family(0, counts=[3] + [0] * (BUCKETS - 1)), "counts sum to 3, running_requests=2"),
        (_family(0, family="f" * 300), "expected a string of at most 256 characters"),
        (_family(0, slots_sum=95), "slots_sum=95, but the 2 running requests, every one listed"),
        ({**GOOD, "families": GOOD["families"] * 2}, "'c4_kv' listed twice"),
        ({**GOOD, "requests": GOOD["requests"] * 2}, "4 requests listed, running_requests=2"),
        (  # the listed requests of 32 and 64 slots are counted in no bucket that holds them
            _family(0, counts=[2] + [0] * (BUCKETS - 1), slots_sum=96),
            "2 listed requests hold <= 64 slots, counts[1]=0",
        ),
        (  # 10 running, 2 listed: the other 8 cannot hold 10^12 slots in buckets <= 64
            {
                **GOOD,
                "running_requests": 10,
                "families": [
                    {**GOOD["families"][0], "counts": [0, 10] + [0] * (BUCKETS - 2),
                     "slots_sum": 10**12},
                    {**GOOD["families"][1], "counts": [10] + [0] * (BUCKETS - 1), "slots_sum": 4},
                ],
            },
            "slots_sum=1000000000000, outside what counts allow ([170, 640])",
        ),
        (  # a family the snapshot does not have
            {**GOOD, "families": [*GOOD["families"], {"family": "ghost", "slots_sum": 0,
                                                      "counts": [2] + [0] * (BUCKETS - 1)}]},
            "request_slots.families['ghost']: not a family of this snapshot's accounts",
        ),
        (  # more slots than the family has (64)
            _part(("a", 65, 0)),
            "request_slots.requests[0]: c4_kv: slots=65, more than the family's 64 slots",
        ),
    ],
)  # fmt: skip
def test_what_a_file_cannot_hold_is_refused_naming_the_value(published, part, needle) -> None:
    e = refused(with_snapshot(published, request_slots=part))
    assert e.reason == "schema" and needle in e.detail, e.detail


def test_the_buckets_are_increasing_powers_of_four() -> None:
    assert REQUEST_SLOTS_BUCKETS[0] == 16 and all(
        b == a * 4 for a, b in itertools.pairwise(REQUEST_SLOTS_BUCKETS)
    )
