"""A real Prometheus (Debian's package) scraping a real uvicorn server: what it stores is exactly
what /metrics exports, and equals /debug/kv at the same epoch."""

from __future__ import annotations

import httpx
import pytest

from accounting.figures import FIGURES
from accounting.snapfile.writer import Publisher
from exporter import metrics as m
from exporter.app import create_app
from exporter.sources import Sources
from tests.exporter.test_app import exposed_names
from tests.ledgers import small_ledger
from tests.servers import PROMETHEUS, Prometheus, UvicornThread, wait_until

pytestmark = pytest.mark.slow
PROMETHEUS_OWN = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}


def _series_of_exposition(text: str) -> set[tuple[str, frozenset]]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items()))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _wait_epoch(prom: Prometheus, epoch: int) -> None:
    wait_until(
        lambda: [r for r in prom.query("kvledger_snapshot_epoch") if float(r["value"][1]) == epoch],
        15,
        f"prometheus stored epoch {epoch} (log: {prom.log_text()[-2000:]})",
        interval=0.2,
    )


def _check_values_equal_debug(prom: Prometheus, debug: dict) -> None:
    [src] = debug["sources"]
    for fam in src["families"]:
        for f in FIGURES:
            q = f'sglang:kv_cache_{f.name}{{family="{fam["family"]}",owner="{fam["owner"]}"}}'
            [r] = prom.query(q)
            assert float(r["value"][1]) == fam["figures"][f.name], q
    [r] = prom.query(m.HEADLINE)
    assert float(r["value"][1]) == pytest.approx(src["memory_usage_gb"], rel=1e-12)
    [r] = prom.query('kvledger_unattributed_bytes{truth="host_memfd"}')
    assert float(r["value"][1]) == src["reconciliation"][0]["unattributed_bytes"]
    acc = next(a for a in src["accounts"] if a["family"] == "swa_kv")
    [r] = prom.query('kvledger_pages_mapped_total{family="swa_kv"}')
    assert float(r["value"][1]) == acc["pages_mapped_total"]
    assert src["holders"]
    for h in src["holders"]:
        for holder, slots in h["slots"].items():
            sel = f'{{family="{h["family"]}",owner="{h["owner"]}",holder="{holder}"}}'
            [r] = prom.query(m.HELD_SLOTS + sel)
            assert float(r["value"][1]) == slots, sel
            [r] = prom.query(m.HELD_BYTES + sel)
            assert float(r["value"][1]) == h["bytes"][holder], sel
        [r] = prom.query(f'sglang:kv_cache_evicted_slots_total{{family="{h["family"]}"}}')
        assert float(r["value"][1]) == h["evicted_slots_total"]
    engine = src["engine"]
    [r] = prom.query('sglang:kv_cache_request_bytes_bucket{le="+Inf"}')
    assert float(r["value"][1]) == engine["running_requests"]
    [r] = prom.query("sglang:kv_cache_retracted_requests_total")
    assert float(r["value"][1]) == engine["retracted_requests_total"]


@pytest.mark.skipif(
    not __import__("os").path.exists(PROMETHEUS), reason="needs Debian's prometheus"
)
def test_prometheus_stores_exactly_the_exported_series_and_values(tmp_path):
    with (
        small_ledger({"model_name": "dsv4-test", "tp_rank": "0"}) as sl,
        Publisher(sl.ledger, tmp_path, interval=0.2) as pub,
        UvicornThread(create_app(Sources(tmp_path))) as server,
        Prometheus([f"127.0.0.1:{server.port}"], interval="1s") as prom,
    ):
        from accounting.engine_state import RequestHeld, engine_state

        sl.allocate(700)
        sl.c4.occupy(11)
        sl.c4.set_holders(3, 5)  # and 3 request_only
        sl.c4.count_evicted(7)
        sl.swa.set_holders(0, 0)
        reqs = [RequestHeld("a", 600, 1.0, 600 * 584), RequestHeld("b", 100, 1.0, 5 << 30)]
        sl.ledger.set_engine_state(lambda: engine_state(holders_from="T", requests=reqs))
        epoch = sl.ledger.epoch
        wait_until(lambda: pub.last_snapshot and pub.last_snapshot.epoch == epoch, 5, "published")
        _wait_epoch(prom, epoch)

        text = httpx.get(f"{server.url}/metrics").text
        exported = _series_of_exposition(text)
        stored = {
            (
                s["__name__"],
                frozenset((k, v) for k, v in s.items() if k not in ("__name__", "job", "instance")),
            )
            for s in prom.series('{job="kvledger"}')
            if s["__name__"] not in PROMETHEUS_OWN
        }
        # age changes value, not identity: compare names and label sets
        assert stored == exported
        names = {n for n, _ in stored}
        assert m.HEADLINE in names
        assert names <= m.series_names()
        assert exposed_names(text)[0] == names
        [up] = prom.query('up{job="kvledger"}')
        assert up["value"][1] == "1"

        debug = httpx.get(f"{server.url}/debug/kv").json()
        assert debug["sources"][0]["epoch"] == epoch
        _check_values_equal_debug(prom, debug)

        # the figures move: allocate more and check again at the new epoch
        sl.allocate(900)
        sl.state.occupy(8)
        epoch2 = sl.ledger.epoch
        wait_until(lambda: pub.last_snapshot and pub.last_snapshot.epoch == epoch2, 5, "published")
        _wait_epoch(prom, epoch2)
        debug2 = httpx.get(f"{server.url}/debug/kv").json()
        assert debug2["sources"][0]["epoch"] == epoch2
        _check_values_equal_debug(prom, debug2)
        before, after = debug["sources"][0]["totals"], debug2["sources"][0]["totals"]
        assert after["occupied_slots"] == before["occupied_slots"] + 908
