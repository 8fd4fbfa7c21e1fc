"""A vLLM source through the exporter without vLLM: kvledger.engines.vllm's accounts built from CPU
tensors laid out as vLLM 0.33 lays them (one storage, groups aliasing it), published, read
by `Sources`, exported under kvledger_vllm_* with vLLM's labels, shown in /debug/kv."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger
from accounting.snapfile.writer import Publisher
from exporter import engines
from exporter import metrics as m
from exporter.app import create_app
from exporter.collector import build_families
from exporter.sources import Sources
from kvledger.engines.exports import register_all
from kvledger.engines.vllm import metrics as vllm_metrics
from kvledger.engines.vllm import views as vllm
from kvledger.engines.vllm.export import EXPORT
from kvledger.engines.vllm.groups import register_worker_cache
from tests import browser
from tests.servers import UvicornThread

register_all()  # as `kvledger serve` does: vLLM's sources served in their own shape

BLOCKS, BLOCK = 10, 16
WORKER = {
    "model_name": "tiny",
    "engine": "0",
    "dp_rank": "0",
    "engine_type": "vllm_worker",
    "tp_rank": "1",
    "pp_rank": "0",
}
ENGINE = {"model_name": "tiny", "engine": "0", "dp_rank": "0", "engine_type": "vllm_scheduler"}


def _spec(kind: str, block_size: int = BLOCK) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, kind=kind)


def _worker_cache(kinds: list[str]) -> tuple[dict, SimpleNamespace, int]:
    """One int8 storage; group g's layer l views [BLOCKS, BLOCK, heads, dim] from byte 0 of
    layer slot l (groups overlay each other, as vLLM 0.33's allocate_kv_cache does)."""
    per_layer = BLOCKS * BLOCK * 2 * 8 * 2  # bf16, 2 heads x 8
    layers_per_group = [3, 2, 1][: len(kinds)]
    storage = torch.zeros(per_layer * max(layers_per_group), dtype=torch.int8)
    kv, groups = {}, []
    n = 0
    for kind, nl in zip(kinds, layers_per_group, strict=True):
        names = []
        for slot in range(nl):
            name = f"model.layers.{n}.attn"
            n += 1
            raw = storage[slot * per_layer : (slot + 1) * per_layer]
            kv[name] = raw.view(torch.bfloat16).view(BLOCKS, BLOCK, 2, 8)
            names.append(name)
        groups.append(SimpleNamespace(kv_cache_spec=_spec(kind), layer_names=names))
    config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=groups, kv_cache_tensors=[])
    return kv, config, storage.untyped_storage().nbytes()


def _kind_of(spec) -> str:
    if spec.kind == "broken":
        raise KeyError("a spec kvledger cannot classify")
    return spec.kind


def _slots(ledger: Ledger, family: str, capacity: int, occupied: int) -> Account:
    spec = BufferSpec(family, family, "vllm", Owner.RUNTIME, None, "none", (), 0, capacity, 0, 0)
    acc = ledger.add_account([spec], key=f"vllm/{family}")
    acc.on_slots(occupied, occupied)
    return acc


def _engine_ledger(
    kinds: list[str], in_use: int, evictable: int, held: list[int], engine: str = "0"
) -> Ledger:
    ledger = Ledger({**ENGINE, "engine": engine, "dp_rank": engine})
    _slots(ledger, "kv_pool", BLOCKS, in_use)
    _slots(ledger, "kv_pool_evictable", BLOCKS, evictable)
    for i, (kind, h) in enumerate(zip(kinds, held, strict=True)):
        _slots(ledger, f"g{i}_{kind}", BLOCKS * BLOCK, h)
    return ledger


def _samples(sources: Sources) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in build_families(sources.read())
        for s in fam.samples
    }


def _get(samples, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_worker_and_engine_core_exported_under_vllms_labels() -> None:
    kinds = ["full_attention", "sliding_window", "broken"]
    kv, config, nbytes = _worker_cache(kinds)
    worker = Ledger(WORKER)
    register_worker_cache(worker, config, kv, kind_of=_kind_of)
    engine = _engine_ledger(["full_attention", "sliding_window", "unknown"], 6, 2, [48, 32, 16])
    sources = Sources()
    sources.add_ledger(worker, "w")
    sources.add_ledger(engine, "e")
    s = _samples(sources)
    wl = {"model_name": "tiny", "engine": "0", "tp_rank": "1", "pp_rank": "0"}
    assert _get(s, "kvledger_vllm_kv_cache_physical_bytes", **wl) == nbytes
    assert _get(s, "kvledger_vllm_kv_cache_blocks", **wl) == BLOCKS
    assert _get(s, "kvledger_vllm_kv_block_bytes", **wl) == nbytes // BLOCKS
    for g, (kind, layers) in enumerate(
        zip(["full_attention", "sliding_window", "unknown"], [3, 2, 1], strict=True)
    ):
        gl = {**wl, "group": str(g), "kind": kind}
        views = [kv[n] for n in config.kv_cache_groups[g].layer_names]
        assert _get(s, "kvledger_vllm_group_layers", **gl) == layers
        assert _get(s, "kvledger_vllm_group_tensor_bytes", **gl) == sum(
            t.numel() * t.element_size() for t in views
        )
        assert _get(s, "kvledger_vllm_group_slot_bytes", **gl) == layers * 2 * 8 * 2
        assert _get(s, "kvledger_vllm_group_block_size", **gl) == BLOCK
        # groups alias the one storage: each reports it, whole
        assert _get(s, "kvledger_vllm_group_physical_bytes", **gl) == nbytes
        assert _get(s, "kvledger_vllm_group_reserved_bytes", **gl) == nbytes
    # an unclassified spec is kind "unknown", with its bytes
    assert _get(s, "kvledger_vllm_group_tensor_bytes", group="2", kind="unknown", **wl) > 0
    el = {"model_name": "tiny", "engine": "0"}
    assert _get(s, "kvledger_vllm_blocks", **el) == BLOCKS
    assert _get(s, "kvledger_vllm_occupied_blocks", **el) == 6
    assert _get(s, "kvledger_vllm_free_blocks", **el) == 4
    assert _get(s, "kvledger_vllm_evictable_blocks", **el) == 2
    g0 = {**el, "group": "0", "kind": "full_attention"}
    assert _get(s, "kvledger_vllm_group_occupied_slots", **g0) == 48
    assert _get(s, "kvledger_vllm_group_capacity_slots", **g0) == BLOCKS * BLOCK
    assert _get(s, "kvledger_vllm_group_free_slots", **g0) == 4 * BLOCK
    assert _get(s, "kvledger_vllm_group_evictable_slots", **g0) == 2 * BLOCK
    # the engine core's series carry no worker ranks; no SGLang name is made of either
    names = {n for n, _ in s}
    assert not any(n.startswith("sglang:") for n in names)
    for (n, ls), _ in s.items():
        if n.startswith(vllm_metrics.PREFIX):  # exactly the labels declared
            assert set(dict(ls)) == set(m.METRIC[n].labels), n
    ups = {dict(ls)["engine_type"]: v for (n, ls), v in s.items() if n == "kvledger_up"}
    assert ups == {"vllm_worker": 1, "vllm_scheduler": 1}


def test_an_engine_cores_blocks_by_holder() -> None:
    """kv_pool's holders split its blocks in use; kv_pool_evictable's (free, cached) are
    tree_evictable: the series add up to occupied + evictable, each relation kept."""
    ledger = Ledger(ENGINE)
    pool = _slots(ledger, "kv_pool", BLOCKS, 6)
    evictable = _slots(ledger, "kv_pool_evictable", BLOCKS, 2)
    _slots(ledger, "g0_full_attention", BLOCKS * BLOCK, 5 * BLOCK)
    with Sources() as sources:
        sources.add_ledger(ledger, "e")
        s = _samples(sources)  # no holders read: every block in use unattributed
        assert _get(s, "kvledger_vllm_held_blocks", holder="unattributed") == 6
        pool.set_holders(4, 0)  # as kvledger.engines.vllm.occupancy sets them
        evictable.set_holders(0, 2)
        s = _samples(sources)
        held = {
            h: _get(s, "kvledger_vllm_held_blocks", holder=h)
            for h in ("tree_protected", "tree_evictable", "request_only", "unattributed")
        }
        assert held == {
            "tree_protected": 4,
            "tree_evictable": 2,
            "request_only": 2,
            "unattributed": 0,
        }
        occupied = _get(s, "kvledger_vllm_occupied_blocks", model_name="tiny")
        assert held["tree_protected"] + held["request_only"] + held["unattributed"] == occupied
        assert held["tree_evictable"] == _get(s, "kvledger_vllm_evictable_blocks", engine="0")
        debug = EXPORT.debug(sources.read().views[0])
        assert debug.engine is not None and debug.engine.held_blocks == held


def test_every_vllm_metric_is_declared_and_cannot_clash_with_vllms_names() -> None:
    specs = vllm_metrics.METRICS
    assert specs and all(s.name.startswith("kvledger_vllm_") for s in specs)
    assert all(not s.engine and s.labels[:2] == ("model_name", "engine") for s in specs)
    assert set(specs) <= set(m.METRICS)  # registered with the exporter's one table
    assert not any(s.name.startswith("vllm:") for s in m.METRICS)
    assert engines.claiming(WORKER) is EXPORT and engines.claiming(ENGINE) is EXPORT
    assert engines.claiming({"engine_type": "unified"}) is None


def test_registering_is_idempotent_and_refuses_a_clash() -> None:
    before = m.METRICS
    register_all()
    engines.register(EXPORT)
    assert before == m.METRICS
    clash = SimpleNamespace(
        name="other",
        metrics=(vllm_metrics.METRICS[0],),
        debug_model=None,
        debug_description="",
        slots_add_up=True,
    )
    with pytest.raises(ValueError, match="declared already"):
        engines.register(clash)
    sglang_shaped = SimpleNamespace(
        name="shaped",
        metrics=(m.MetricSpec("kvledger_shaped_x", "gauge", "h", ()),),
        debug_model=None,
        debug_description="",
        slots_add_up=True,
    )
    with pytest.raises(ValueError, match="engine=False"):
        engines.register(sglang_shaped)
    with pytest.raises(ValueError, match="lowercase letters"):
        engines.register(SimpleNamespace(name="Bad-Name", metrics=()))
    assert before == m.METRICS and engines.registered() == (EXPORT,)


def test_group_names() -> None:
    assert vllm.group_of("g12_sliding_window_mla") == (12, "sliding_window_mla")
    assert vllm.group_of("kv_pool") is None
    assert vllm.group_of("g_x") is None


def test_a_published_worker_through_the_app_and_debug_view(tmp_path) -> None:
    kv, config, nbytes = _worker_cache(["full_attention", "sliding_window"])
    worker = Ledger(WORKER)
    register_worker_cache(worker, config, kv, kind_of=_kind_of)
    engine = _engine_ledger(["full_attention", "sliding_window"], 3, 1, [16, 16])
    with (
        Publisher(worker, tmp_path, interval=0.2),
        Publisher(engine, tmp_path, interval=0.2),
        UvicornThread(create_app(Sources(tmp_path))) as server,
    ):
        text = httpx.get(f"{server.url}/metrics").text
        labels = 'engine="0",model_name="tiny",pp_rank="0",tp_rank="1"'
        assert f"kvledger_vllm_kv_cache_physical_bytes{{{labels}}} {nbytes}\n" in text
        debug = httpx.get(f"{server.url}/debug/kv", headers={"Accept": "application/json"}).json()
        by_role = {s["vllm"]["role"]: s["vllm"] for s in debug["sources"]}
        assert set(by_role) == {"vllm_worker", "vllm_scheduler"}
        w = by_role["vllm_worker"]["worker"]
        assert w["physical_bytes"] == nbytes and w["blocks"] == BLOCKS
        assert [(g["group"], g["kind"], g["layers"]) for g in w["groups"]] == [
            (0, "full_attention", 3),
            (1, "sliding_window", 2),
        ]
        e = by_role["vllm_scheduler"]["engine"]
        assert (e["occupied_blocks"], e["evictable_blocks"], e["free_blocks"]) == (3, 1, 7)
        assert by_role["vllm_worker"]["labels"] == {
            "model_name": "tiny",
            "engine": "0",
            "tp_rank": "1",
            "pp_rank": "0",
        }
        # Totals: the bytes add up (the storage, once); the slots do not (kv_pool's blocks,
        # the groups' tokens aliasing them): null, in the sources and in the ranks alike.
        for totals in [s["totals"] for s in debug["sources"]] + [
            r["totals"] for r in debug["ranks"]
        ]:
            assert totals["capacity_slots"] is None and totals["occupied_slots"] is None
        [worker_totals] = [
            s["totals"] for s in debug["sources"] if s["vllm"]["role"] == "vllm_worker"
        ]
        assert worker_totals["physical_bytes"] == worker_totals["tensor_bytes"] == nbytes


def test_a_worker_whose_buffer_rows_fail_is_left_out_and_the_rest_served(tmp_path) -> None:
    kv, config, _ = _worker_cache(["full_attention"])
    worker = Ledger(WORKER)
    register_worker_cache(worker, config, kv, kind_of=_kind_of)
    engine = _engine_ledger(["full_attention"], 2, 0, [16])
    published = tmp_path / "pub"
    served = tmp_path / "served"
    served.mkdir(mode=0o700)
    with Publisher(worker, published, interval=60) as pub:
        name = pub.path.rsplit("/", 1)[1]
        head = (published / name).read_bytes().split(b"\n", 1)[0]
    (served / name).write_bytes(head + b"\n[]\n")  # its first line, no buffer rows
    (served / name).chmod(0o600)
    with Sources(served) as sources:
        sources.add_ledger(engine, "e")
        s = _samples(sources)
    names = {n for n, _ in s}
    assert "kvledger_vllm_kv_cache_physical_bytes" not in names  # the worker: left out
    assert _get(s, "kvledger_vllm_occupied_blocks", model_name="tiny") == 2  # the rest: served
    assert _get(s, "kvledger_source_errors_total", reason="render") == 1


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_shows_the_vllm_groups() -> None:
    from exporter import html

    kv, config, _ = _worker_cache(["full_attention", "sliding_window"])
    worker = Ledger(WORKER)
    register_worker_cache(worker, config, kv, kind_of=_kind_of)
    engine = _engine_ledger(["full_attention", "sliding_window"], 3, 1, [32, 16])
    sources = Sources()
    sources.add_ledger(worker, "w")
    sources.add_ledger(engine, "e")
    with UvicornThread(create_app(sources, debug_html=html.page)) as server:
        parsed = browser.parse(browser.dump_dom(f"{server.url}/debug/kv"))
    roles = {e["data-vllm-role"] for e in parsed.elements if "data-vllm-role" in e}
    assert roles == {"vllm_worker", "vllm_scheduler"}
    addressed = {
        e["data-group"]: int(e["data-tensor-bytes"])
        for e in parsed.elements
        if "data-tensor-bytes" in e
    }
    views = [
        sum(kv[n].numel() * kv[n].element_size() for n in g.layer_names)
        for g in config.kv_cache_groups
    ]
    assert addressed == {"0": views[0], "1": views[1]}
    kinds = {e["data-vllm-group"]: e["data-kind"] for e in parsed.elements if "data-kind" in e}
    assert kinds == {"0": "full_attention", "1": "sliding_window"}
    occupied = {
        e["data-group"]: int(e["data-occupied-slots"])
        for e in parsed.elements
        if "data-occupied-slots" in e
    }
    assert occupied == {"0": 32, "1": 16}
    text = " ".join(parsed.text)
    assert "vLLM tiny engine 0 worker tp1 pp0" in text and "vLLM tiny engine 0 engine core" in text
    assert "3 in use, 7 free (1 of them evictable" in text


def test_tp_ranks_and_dp_engines_are_series_of_their_own() -> None:
    """Two TP workers of engine 0, one of engine 1, and both engine cores: no two claim the
    same engine labels (none is taken for a conflict) and each is its own series."""
    sources = Sources()
    for engine, tp in (("0", "0"), ("0", "1"), ("1", "0")):
        kv, config, _ = _worker_cache(["full_attention"])
        ledger = Ledger({**WORKER, "engine": engine, "dp_rank": engine, "tp_rank": tp})
        register_worker_cache(ledger, config, kv, kind_of=_kind_of)
        sources.add_ledger(ledger, f"w{engine}{tp}")
    for engine, in_use in (("0", 3), ("1", 5)):
        ledger = _engine_ledger(["full_attention"], in_use, 0, [16], engine=engine)
        sources.add_ledger(ledger, f"e{engine}")
    scan = sources.read()
    assert all(v.up for v in scan.views), [v.stale_reason for v in scan.views]
    s = _samples(sources)
    workers = {
        (dict(ls)["engine"], dict(ls)["tp_rank"])
        for (n, ls), _ in s.items()
        if n == "kvledger_vllm_kv_cache_physical_bytes"
    }
    assert workers == {("0", "0"), ("0", "1"), ("1", "0")}
    assert _get(s, "kvledger_vllm_occupied_blocks", engine="0") == 3
    assert _get(s, "kvledger_vllm_occupied_blocks", engine="1") == 5


def test_a_workers_rows_are_read_once_per_change_not_per_heartbeat(tmp_path, monkeypatch) -> None:
    import time

    calls: list[int] = []
    real = vllm.worker_view

    def counting(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(vllm, "worker_view", counting)
    kv, config, nbytes = _worker_cache(["full_attention"])
    worker = Ledger(WORKER)
    register_worker_cache(worker, config, kv, kind_of=_kind_of)
    with Publisher(worker, tmp_path, interval=0.1), Sources(tmp_path) as sources:
        first = sources.read().views[0].published
        assert _get(_samples(sources), "kvledger_vllm_kv_cache_physical_bytes") == nbytes
        time.sleep(0.35)  # heartbeats: new versions of the file, the same rows
        assert sources.read().views[0].published is not first
        assert _get(_samples(sources), "kvledger_vllm_kv_cache_physical_bytes") == nbytes
        assert len(calls) == 1
        kv2, config2, _ = _worker_cache(["full_attention", "sliding_window"])
        worker.remove_account(worker.accounts()[0])  # a change: the rows are read again
        register_worker_cache(worker, config2, kv2, kind_of=_kind_of, pool="vllm2")
        time.sleep(0.25)
        _samples(sources)
        assert len(calls) == 2
