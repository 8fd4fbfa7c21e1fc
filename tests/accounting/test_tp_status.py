"""accounting.tp_status and how a ledger carries it into snapshots."""

from __future__ import annotations

import dataclasses

import pytest

from accounting import Ledger, Snapshot
from accounting.tp_status import TP_COUNTERS, TpStatus


def status(**kw: object) -> TpStatus:
    base: dict[str, object] = {
        "rank": 1,
        "size": 2,
        "exchanges_total": 5,
        "page_ops_total": 7,
        "divergences_total": 0,
        "peer_failures_total": 0,
    }
    return TpStatus(**{**base, **kw})  # type: ignore[arg-type]


def test_round_trip() -> None:
    s = status(divergences_total=1, last_error="rank 1 differs")
    assert TpStatus.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"exchanges_total": -1}, "exchanges_total=-1, expected a non-negative int"),
        ({"divergences_total": -2}, "divergences_total=-2"),
        ({"rank": 2}, r"rank=2, expected 0 <= rank < size=2"),
        ({"size": 1.5}, "size=1.5"),
    ],
)
def test_bad_values_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        status(**kw)


def test_snapshot_carries_it_and_round_trips() -> None:
    ledger = Ledger(labels={"tp_rank": "1"})
    assert ledger.snapshot().tp is None
    assert ledger.snapshot().to_dict()["tp"] is None
    counts = {"n": 0}

    def source() -> TpStatus:
        counts["n"] += 1
        return status(exchanges_total=counts["n"])

    epoch = ledger.epoch
    ledger.set_tp_status(source)
    assert ledger.epoch == epoch + 1
    snap = ledger.snapshot()
    assert snap.tp == status(exchanges_total=1)  # read once per snapshot
    d = snap.to_dict()
    assert d["tp"]["exchanges_total"] == 1 and d["tp"]["divergences_total"] == 0
    assert Snapshot.from_dict(d).tp == snap.tp
    d.pop("tp")  # a snapshot written before the field existed
    assert Snapshot.from_dict(d).tp is None
    ledger.set_tp_status(None)
    assert ledger.snapshot().tp is None


def test_the_counters_are_named_once_and_are_every_total_field() -> None:
    totals = tuple(f.name for f in dataclasses.fields(TpStatus) if f.name.endswith("_total"))
    assert totals == TP_COUNTERS
