"""A TP rank's control-traffic counters reach /metrics with its tp_rank; a pool without TP
exports none of them."""

from __future__ import annotations

from accounting.tp_status import TpStatus
from exporter.collector import registry_for
from exporter.sources import Sources
from tests.ledgers import small_ledger


def _samples(sources: Sources) -> dict[tuple[str, str], float]:
    out = {}
    for fam in registry_for(sources).collect():
        for s in fam.samples:
            if s.name.startswith("kvledger_tp_"):
                out[(s.name, s.labels["tp_rank"])] = s.value
    return out


def test_tp_counters_are_exported_per_rank_only_under_tp() -> None:
    with small_ledger({"model_name": "m", "tp_rank": "1"}) as sl:
        sources = Sources()
        sources.add_ledger(sl.ledger)
        assert _samples(sources) == {}
        status = TpStatus(
            rank=1,
            size=2,
            exchanges_total=7,
            page_ops_total=12,
            divergences_total=1,
            peer_failures_total=0,
            last_error="x",
        )
        sl.ledger.set_tp_status(lambda: status)
        got = _samples(sources)
        assert got == {
            ("kvledger_tp_exchanges_total", "1"): 7,
            ("kvledger_tp_page_ops_total", "1"): 12,
            ("kvledger_tp_divergences_total", "1"): 1,
            ("kvledger_tp_peer_failures_total", "1"): 0,
        }


def test_debug_kv_shows_the_tp_status_with_the_last_error() -> None:
    from fastapi.testclient import TestClient

    from exporter.app import create_app

    with small_ledger({"model_name": "m", "tp_rank": "1"}) as sl:
        sources = Sources()
        sources.add_ledger(sl.ledger)
        client = TestClient(create_app(sources))
        assert client.get("/debug/kv").json()["sources"][0]["tp"] is None
        status = TpStatus(
            rank=1,
            size=2,
            exchanges_total=3,
            page_ops_total=4,
            divergences_total=1,
            peer_failures_total=0,
            last_error="rank 1 view ... rank 0 view ...",
        )
        sl.ledger.set_tp_status(lambda: status)
        tp = client.get("/debug/kv").json()["sources"][0]["tp"]
        assert tp["divergences_total"] == 1 and tp["last_error"].startswith("rank 1 view")
