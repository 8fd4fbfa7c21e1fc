"""/debug/kv for a person: content negotiation, the page's embedding, and the page itself rendered
by headless Chromium against a running `kvledger serve` (its live numbers, its own refresh)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from exporter import html
from exporter.app import wants_html
from tests import browser
from tests.kvledger.tools.dashboards.live import KvledgerServe


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", True),  # browsers
        ("application/json", False),
        ("*/*", False),  # curl
        (None, False),
    ],
)
def test_browsers_get_the_page_and_the_rest_json(accept, expected):
    assert wants_html(accept) is expected


def test_render_embeds_the_document_and_cannot_be_broken_out_of():
    doc = {"sources": [], "note": "</script><script>alert(1)</script><!--"}
    page = html.render(doc, refresh_seconds=1.5)
    assert "__KVLEDGER" not in page
    assert "</script><script>alert(1)" not in page
    assert "REFRESH_MS = 1500;" in page
    data = re.search(r'<script id="kv-data" type="application/json">(.*?)</script>', page, re.S)
    assert data and json.loads(data.group(1)) == doc
    for far in ("http://", "https://", "//cdn", "@import"):
        assert far not in page.replace('href="/metrics"', ""), far


def test_render_rejects_a_bad_refresh():
    with pytest.raises(ValueError, match="refresh_seconds=0"):
        html.render({}, refresh_seconds=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with KvledgerServe(tmp_path_factory.mktemp("snapshots")) as serve:
        yield serve


def _figures_in_page(parsed: browser.DataAttributes) -> dict[tuple[str, str], int]:
    return {
        (e["data-family"], e["data-figure"]): int(e["data-value"])
        for e in parsed.elements
        if "data-family" in e and "data-figure" in e
    }


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_the_page_for_a_browser_and_json_for_the_rest(served):
    page = httpx.get(f"{served.base}/debug/kv", headers={"Accept": "text/html"}, timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    plain = httpx.get(f"{served.base}/debug/kv", timeout=5)
    assert plain.headers["content-type"].startswith("application/json")
    bad = httpx.get(f"{served.base}/debug/kv?family=nope", headers={"Accept": "text/html"})
    assert bad.status_code == 400 and bad.json()["param"] == "family"


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_renders_the_live_numbers_and_refreshes(served):
    before = served.debug()
    src = before["sources"][0]
    parsed = browser.parse(browser.dump_dom(f"{served.base}/debug/kv", budget_ms=6000))
    after = served.debug()
    root = next(e for e in parsed.elements if e.get("id") == "root")
    assert int(root["data-refreshes"]) >= 1, "the page did not refresh itself from the JSON"
    page_epoch = int(next(e["data-epoch"] for e in parsed.elements if "data-epoch" in e))
    assert src["epoch"] <= page_epoch <= after["sources"][0]["epoch"]
    shown = _figures_in_page(parsed)
    families = {f["family"]: f["figures"] for f in src["families"]}
    assert len(families) == 7 and {fam for fam, _ in shown} == set(families)
    for fam, figs in families.items():
        for static in ("tensor_bytes", "reserved_bytes", "capacity_slots"):
            assert shown[(fam, static)] == figs[static], (fam, static)
        assert shown[(fam, "physical_bytes")] > 0, fam
    text = " ".join(parsed.text)
    assert "refresh failed" not in text
    assert "every relation holds" in text
    assert "every snapshot file in the directory is served" in text
    assert "host_memfd" in text  # the reconciliation table
    ranks = [e for e in parsed.elements if "data-rank-source" in e]
    assert [e["data-rank-source"] for e in ranks] == [src["source"]]
    # the per-rank table adds bytes over families, never slots: those are shown per family
    per_rank = [e for e in parsed.elements if e.get("data-scope") == "rank"]
    summed = {e["data-figure"] for e in per_rank if "data-rank-family" not in e}
    assert summed == {f["name"] for f in before["figures"] if f["unit"] == "bytes"}
    slots = {
        (e["data-rank-family"], e["data-figure"]): int(e["data-value"])
        for e in per_rank
        if "data-rank-family" in e
    }
    assert {fam for fam, _ in slots} == set(families)
    for fam in families:
        assert slots[(fam, "capacity_slots")] == families[fam]["capacity_slots"], fam


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_screenshot(served, tmp_path):
    png = browser.screenshot(f"{served.base}/debug/kv", tmp_path / "page.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_two_ranks_and_a_family_filter_that_survives_refresh():
    from exporter.app import create_app
    from exporter.sources import Sources
    from tests.ledgers import small_ledger
    from tests.servers import UvicornThread

    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as r0,
        small_ledger({"model_name": "m", "tp_rank": "1"}) as r1,
    ):
        r0.allocate(300)
        r1.allocate(700)
        sources = Sources()
        sources.add_ledger(r0.ledger)
        sources.add_ledger(r1.ledger)
        with UvicornThread(create_app(sources, debug_html=html.page)) as server:
            parsed = browser.parse(browser.dump_dom(f"{server.url}/debug/kv?family=swa_kv"))
    root = next(e for e in parsed.elements if e.get("id") == "root")
    assert int(root["data-refreshes"]) >= 1
    sections = [e["data-source"] for e in parsed.elements if e.get("class") == "source"]
    assert len(sections) == 2
    shown = {
        (e["data-source"], e["data-figure"]): int(e["data-value"])
        for e in parsed.elements
        if e.get("data-family") == "swa_kv" and "data-figure" in e
    }
    assert {f for e in parsed.elements if (f := e.get("data-family"))} == {"swa_kv"}
    occupied = sorted(v for (_, fig), v in shown.items() if fig == "occupied_slots")
    assert occupied == [300, 700]
    assert "filtered: family=swa_kv" in " ".join(parsed.text)
    assert len([e for e in parsed.elements if "data-rank-source" in e]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_lists_files_not_served_and_a_failed_buffer_map(tmp_path):
    """A refused file is listed with its reason and detail; a file whose first line is good
    but whose buffer rows are not is shown with its figures and why its rows are not."""
    from accounting.snapfile.format import parse
    from accounting.snapfile.writer import Publisher
    from exporter.app import create_app
    from exporter.sources import Sources
    from tests.ledgers import small_ledger
    from tests.servers import UvicornThread

    with small_ledger({"model_name": "m", "tp_rank": "0"}) as sl:
        sl.allocate(300)
        with Publisher(sl.ledger, tmp_path, interval=1000, source="good") as pub:
            envelope, rows = parse(Path(pub.path).read_bytes())
            snap = envelope["snapshot"]
            snap = {**snap, "labels": {**snap["labels"], "tp_rank": "1"}}
            bad = {**envelope, "source": "rows", "snapshot": snap}
            (tmp_path / "rows.json").write_bytes(json.dumps(bad).encode() + b"\n" + rows[:-9])
            (tmp_path / "junk.json").write_bytes(b"<script>alert(1)</script>\n[]")
            sources = Sources(tmp_path)
            with UvicornThread(create_app(sources, debug_html=html.page)) as server:
                parsed = browser.parse(browser.dump_dom(f"{server.url}/debug/kv"))
                doc = httpx.get(f"{server.url}/debug/kv", timeout=5).json()
    root = next(e for e in parsed.elements if e.get("id") == "root")
    assert int(root["data-refreshes"]) >= 1
    listed = {e["data-file"]: e["data-reason"] for e in parsed.elements if "data-file" in e}
    assert listed == {"junk.json": "parse"}
    text = " ".join(parsed.text)
    assert "Files not served" in text and doc["files_not_served"][0]["detail"] in text
    [error] = [e["data-buffers-error"] for e in parsed.elements if "data-buffers-error" in e]
    by_source = {s["source"]: s for s in doc["sources"]}
    assert error == by_source["rows"]["buffers_error"] and error.startswith("parse: not JSON")
    assert by_source["rows"]["buffers"] == [] and by_source["good"]["buffers"]
    assert by_source["good"]["buffers_error"] is None
    sections = {e["data-source"] for e in parsed.elements if e.get("class") == "source"}
    assert sections == {"good", "rows"}  # both served, figures shown


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_shows_who_holds_each_family_and_the_largest_requests():
    """The holders of every family as the JSON has them, the binding family, the reader's
    notes, and the largest requests by id: "which sessions hold my SWA family"."""
    from accounting.engine_state import RequestHeld, engine_state
    from exporter.app import create_app
    from exporter.sources import Sources
    from tests.ledgers import small_ledger
    from tests.servers import UvicornThread

    with small_ledger({"model_name": "m", "tp_rank": "0"}) as sl:
        sl.allocate(600)
        sl.c4.occupy(40)
        sl.c4.set_holders(10, 20)
        sl.swa.set_holders(0, 0)
        reqs = [
            RequestHeld("sess-big", 500, 3.0, 500 * 584, {"swa_kv": 500 * 584}),
            RequestHeld("sess-small", 100, 1.0, 100 * 584, {"swa_kv": 100 * 584}),
        ]
        sl.ledger.set_engine_state(
            lambda: engine_state(
                holders_from="TestTree", notes=["HiCache host tier on: not counted"], requests=reqs
            )
        )
        sources = Sources()
        sources.add_ledger(sl.ledger)
        with UvicornThread(create_app(sources, debug_html=html.page)) as server:
            doc = httpx.get(f"{server.url}/debug/kv", timeout=5).json()
            parsed = browser.parse(browser.dump_dom(f"{server.url}/debug/kv"))
    src = doc["sources"][0]
    shown = {
        (e["data-family"], e["data-figure"], e["data-holder"]): int(e["data-value"])
        for e in parsed.elements
        if "data-holder" in e
    }
    for h in src["holders"]:
        for holder, slots in h["slots"].items():
            assert shown[(h["family"], "held_slots", holder)] == slots
            assert shown[(h["family"], "held_bytes", holder)] == h["bytes"][holder]
    c4 = next(h for h in src["holders"] if h["family"] == "c4_kv")
    assert c4["slots"] == {
        "tree_protected": 10, "tree_evictable": 20, "request_only": 10, "unattributed": 0
    }  # fmt: skip
    swa = next(h for h in src["holders"] if h["family"] == "swa_kv")
    assert swa["slots"]["request_only"] == 600
    text = " ".join(parsed.text)
    assert "Who holds the KV cache" in text and "read from TestTree" in text
    assert any(e.get("data-note") == "HiCache host tier on: not counted" for e in parsed.elements)
    rids = list(dict.fromkeys(e["data-rid"] for e in parsed.elements if "data-rid" in e))
    assert rids == ["sess-big", "sess-small"]
    assert "binding" in text
    assert doc["holders"]["relation"] in text  # listed, and ticked, with the other relations
    assert "every relation holds" in text
