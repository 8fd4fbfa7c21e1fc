"""An engine core's holders per group and its running requests' footprints, through a
published file, `kvledger serve`'s app and /debug/kv, without vLLM: the accounts and the
`request_slots` part as kvledger.engines.vllm.occupancy sets them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.utils import floatToGoString

from accounting.ledger import Ledger
from accounting.request_slots import REQUEST_SLOTS_BUCKETS, request_slots
from accounting.snapfile.format import parse
from accounting.snapfile.writer import Publisher
from exporter.app import create_app
from exporter.collector import build_families
from exporter.sources import Sources
from kvledger.engines.exports import register_all
from tests import browser
from tests.kvledger.engines.vllm.test_export import BLOCK, BLOCKS, ENGINE, _get, _slots
from tests.servers import UvicornThread

register_all()

GROUPS = ("g0_full_attention", "g1_sliding_window")
E = {"model_name": "tiny", "engine": "0"}


def _engine(tmp_path: Path | None = None) -> tuple[Ledger, list]:
    """Blocks: 6 in use (the null block among them), 2 evictable. g0 holds 4 blocks, 3 of
    them cached; g1 holds 1, not cached; g0 has 2 free cached blocks, g1 none. Three
    requests run: a and b share g0's 3 cached blocks."""
    ledger = Ledger(ENGINE)
    pool = _slots(ledger, "kv_pool", BLOCKS, 6)
    pool.set_holders(3, 0)
    _slots(ledger, "kv_pool_evictable", BLOCKS, 2).set_holders(0, 2)
    g0 = _slots(ledger, GROUPS[0], BLOCKS * BLOCK, 4 * BLOCK)
    g0.set_holders(3 * BLOCK, 0)
    g1 = _slots(ledger, GROUPS[1], BLOCKS * BLOCK, 1 * BLOCK)
    g1.set_holders(0, 0)
    _slots(ledger, "evictable_" + GROUPS[0], BLOCKS * BLOCK, 2 * BLOCK).set_holders(0, 2 * BLOCK)
    _slots(ledger, "evictable_" + GROUPS[1], BLOCKS * BLOCK, 0).set_holders(0, 0)
    running = [
        ("a", 60, (4 * BLOCK, 1 * BLOCK)),
        ("b\x1b[2J", 50, (3 * BLOCK, 0)),  # a terminal escape in an id: published cleaned
        ("c", 0, (0, 0)),
    ]
    part = request_slots(GROUPS, running)
    ledger.set_request_slots(lambda: part)
    return ledger, running


def _samples(sources: Sources) -> dict:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in build_families(sources.read())
        for s in fam.samples
    }


def test_holders_per_group_and_the_footprint_histogram(tmp_path: Path) -> None:
    ledger, running = _engine()
    with Publisher(ledger, tmp_path, interval=60), Sources(tmp_path) as sources:
        s = _samples(sources)
    for i, family in enumerate(GROUPS):
        kind = family.split("_", 1)[1]
        gl = {**E, "group": str(i), "kind": kind}
        held = {
            h: _get(s, "kvledger_vllm_group_held_slots", holder=h, **gl)
            for h in ("tree_protected", "request_only", "unattributed", "tree_evictable")
        }
        occupied = _get(s, "kvledger_vllm_group_occupied_slots", **gl)
        assert held["tree_protected"] + held["request_only"] + held["unattributed"] == occupied
        assert held["tree_evictable"] == (2 * BLOCK if i == 0 else 0)
        assert held["unattributed"] == 0
        # The histogram: every running request counted, the sum every request's slots.
        slots = [r[2][i] for r in running]
        count = _get(s, "kvledger_vllm_request_slots_count", **gl)
        assert count == len(running) == _get(s, "kvledger_vllm_running_requests", **E)
        assert _get(s, "kvledger_vllm_request_slots_sum", **gl) == sum(slots)
        for le in REQUEST_SLOTS_BUCKETS:
            got = _get(s, "kvledger_vllm_request_slots_bucket", le=floatToGoString(le), **gl)
            assert got == sum(1 for x in slots if x <= le), le
        assert _get(s, "kvledger_vllm_request_slots_bucket", le="+Inf", **gl) == len(running)
    # Shared prefix blocks count in both requests: g0's footprints exceed its occupied slots.
    g0 = {**E, "group": "0", "kind": "full_attention"}
    assert _get(s, "kvledger_vllm_request_slots_sum", **g0) > _get(
        s, "kvledger_vllm_group_occupied_slots", **g0
    )
    assert not any(n.startswith("sglang:") for n, _ in s)


def test_debug_lists_the_largest_requests_with_ids_cleaned(tmp_path: Path) -> None:
    ledger, _ = _engine()
    with (
        Publisher(ledger, tmp_path, interval=60) as pub,
        UvicornThread(create_app(Sources(tmp_path))) as server,
    ):
        envelope, _ = parse(Path(pub.path).read_bytes())
        debug = httpx.get(f"{server.url}/debug/kv", headers={"Accept": "application/json"}).json()
    assert envelope["snapshot"]["request_slots"]["requests"][1]["rid"] == "b?[2J"
    (source,) = debug["sources"]
    e = source["vllm"]["engine"]
    assert e["running_requests"] == 3
    assert [(r["rid"], r["tokens"], r["slots"], r["blocks"]) for r in e["requests"]] == [
        ("a", 60, [4 * BLOCK, BLOCK], [4, 1]),
        ("b?[2J", 50, [3 * BLOCK, 0], [3, 0]),
        ("c", 0, [0, 0], [0, 0]),
    ]
    g0 = e["groups"][0]
    assert g0["held_slots"] == {
        "tree_protected": 3 * BLOCK,
        "tree_evictable": 2 * BLOCK,
        "request_only": BLOCK,
        "unattributed": 0,
    }
    assert g0["request_slots_sum"] == 7 * BLOCK and sum(g0["request_slots_counts"]) == 3


def test_a_file_whose_footprints_lie_is_refused_and_the_rest_served(tmp_path: Path) -> None:
    """A request claiming more slots than its group has: the engine core's file is refused
    (named in the source's last error), never served."""
    ledger, _ = _engine()
    published, served = tmp_path / "pub", tmp_path / "served"
    served.mkdir(mode=0o700)
    with Publisher(ledger, published, interval=60) as pub:
        name = pub.path.rsplit("/", 1)[1]
        head, rows = (published / name).read_bytes().split(b"\n", 1)
    env = json.loads(head)
    part = env["snapshot"]["request_slots"]
    part["requests"][0]["slots_by_family"][GROUPS[0]] = 10**6  # a's 4 blocks said 62,500
    g0 = part["families"][0]  # its histogram and sum made to agree: only the bound catches it
    g0["counts"][1] -= 1
    g0["counts"][8] += 1
    g0["slots_sum"] += 10**6 - 4 * BLOCK
    (served / name).write_bytes(json.dumps(env).encode() + b"\n" + rows)
    (served / name).chmod(0o600)
    with Sources(served) as sources:
        scan = sources.read()
        s = _samples(sources)
    assert not scan.views  # never served
    assert not any(n.startswith("kvledger_vllm_") for n, _ in s)
    assert _get(s, "kvledger_snapshot_file_errors_total", reason="schema") == 1
    (problem,) = scan.files.problems
    assert problem.reason == "schema"
    assert "slots=1000000, more than the family's 160 slots" in problem.detail, problem.detail


def test_no_footprints_published_no_series() -> None:
    """An engine core that publishes no `request_slots` (an older kvledger): no histogram,
    no running_requests; its holders per group still served."""
    ledger = Ledger(ENGINE)
    _slots(ledger, "kv_pool", BLOCKS, 2)
    _slots(ledger, "kv_pool_evictable", BLOCKS, 0)
    _slots(ledger, GROUPS[0], BLOCKS * BLOCK, BLOCK)  # holders never set: unattributed
    with Sources() as sources:
        sources.add_ledger(ledger, "e")
        s = _samples(sources)
    names = {n for n, _ in s}
    assert "kvledger_vllm_running_requests" not in names
    assert not any(n.startswith("kvledger_vllm_request_slots") for n in names)
    gl = {**E, "group": "0", "kind": "full_attention"}
    assert _get(s, "kvledger_vllm_group_held_slots", holder="unattributed", **gl) == BLOCK
    assert _get(s, "kvledger_vllm_group_held_slots", holder="tree_evictable", **gl) == 0


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_lists_the_requests_as_text() -> None:
    """The page lists the engine core's largest requests under its groups; an id that
    looks like markup is shown as text, never parsed."""
    from exporter import html

    ledger, _ = _engine()
    part = request_slots(GROUPS, [("<img src=x onerror=alert(1)>", 33, (2 * BLOCK, 0))])
    ledger.set_request_slots(lambda: part)
    sources = Sources()
    sources.add_ledger(ledger, "e")
    with UvicornThread(create_app(sources, debug_html=html.page)) as server:
        dom = browser.dump_dom(f"{server.url}/debug/kv")
    parsed = browser.parse(dom)
    (table,) = [e for e in parsed.elements if "data-vllm-requests" in e]
    assert table["data-vllm-requests"] == "1"
    rids = [e["data-rid"] for e in parsed.elements if "data-rid" in e]
    assert rids == ["<img src=x onerror=alert(1)>"]
    assert "<img" not in dom  # the id is text (&lt;img ...), no element made of it
    text = " ".join(parsed.text)
    assert "<img src=x onerror=alert(1)>" in text and "1 running requests" in text
    protected = {e["data-tree-protected"] for e in parsed.elements if "data-tree-protected" in e}
    assert protected == {str(3 * BLOCK), "0"}
