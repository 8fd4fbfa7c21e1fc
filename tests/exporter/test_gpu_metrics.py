"""The GPU parts as exported: `kvledger_gpu_memory_bytes{part}` and the device total, the GPU's
`UUID` and `gpu` (dcgm-exporter's labels) on every series of the source, the "Where the GPU
went" section of /debug/kv, and a GPU that disappears (`kvledger_truth_available 0`, no parts,
no crash). Published to a file and read back, as `kvledger serve` does."""

from __future__ import annotations

import pynvml
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from accounting.gpu_parts import PART_NAMES
from accounting.snapfile.writer import Publisher
from exporter import metrics as m
from exporter.app import create_app
from exporter.html import page
from exporter.sources import Sources
from tests import browser
from tests.accounting.gpu_rig import MiB, gpu_rig
from tests.accounting.nvml_standin import INDEX, UUID
from tests.servers import UvicornThread

DEVICE = {"UUID": UUID, "gpu": str(INDEX)}


def _scrape(client: TestClient) -> list:
    r = client.get("/metrics", headers={"Accept": "text/plain"})
    assert r.status_code == 200
    return [s for f in text_string_to_metric_families(r.text) for s in f.samples]


@pytest.fixture
def served(tmp_path, monkeypatch):
    with gpu_rig(monkeypatch) as rig:
        rig.sl.allocate(900)
        rig.torch_mem.add((1, 0), 12 * MiB, 12 * MiB)  # a captured graph's pool
        pub = Publisher(rig.sl.ledger, tmp_path, interval=60)
        with Sources(tmp_path) as src:
            yield rig, pub, TestClient(create_app(src))
        pub.close()


def test_parts_are_exported_with_the_gpus_uuid_on_every_series(served) -> None:
    rig, pub, client = served
    pub.publish()
    r, _ = rig.parts()
    samples = _scrape(client)
    parts = {s.labels["part"]: s.value for s in samples if s.name == "kvledger_gpu_memory_bytes"}
    assert list(parts) == list(PART_NAMES)
    assert parts == {k: float(v) for k, v in r["parts"].items()}
    assert parts["cuda_graphs"] == 12 * MiB and parts["unattributed"] == 0
    assert sum(parts.values()) == r["detail"]["used_bytes"]
    total = [s for s in samples if s.name == "kvledger_gpu_memory_total_bytes"]
    assert [s.value for s in total] == [float(rig.standin.total)]
    per_source = [s for s in samples if (spec := _spec(s.name)) is not None and spec.engine]
    names = {s.name for s in per_source}
    assert {m.HEADLINE, "kvledger_up", "kvledger_truth_bytes", "kvledger_handle_pages"} <= names
    for s in per_source:
        assert {k: s.labels.get(k) for k in DEVICE} == DEVICE, s
    violations = [s for s in samples if s.name == "kvledger_relation_violations"]
    assert [s.value for s in violations] == [0.0]


def _spec(sample_name: str) -> m.MetricSpec | None:
    for spec in m.METRICS:
        if sample_name in (*spec.sample_names, spec.name, spec.family_name):
            return spec
    return None


def test_debug_kv_shows_where_the_gpu_went(served) -> None:
    _, pub, client = served
    pub.publish()
    doc = client.get("/debug/kv").json()
    (src,) = doc["sources"]
    g = src["gpu"]
    assert (g["uuid"], g["gpu"], g["basis"], g["readable"]) == (UUID, str(INDEX), "process", True)
    assert g["basis_note"] == "read"
    assert [p["part"] for p in g["parts"]] == list(PART_NAMES)
    assert sum(p["bytes"] for p in g["parts"]) == g["device_used_bytes"]
    assert {p["part"]: p["scope"] for p in g["parts"]}["other_processes"] == "device"


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason="needs Debian's chromium")
def test_chromium_renders_where_the_gpu_went(tmp_path, monkeypatch) -> None:
    with gpu_rig(monkeypatch) as rig, Sources() as src:
        rig.sl.allocate(300)
        name = src.add_ledger(rig.sl.ledger)
        r, _ = rig.parts()
        with UvicornThread(create_app(src, debug_html=page)) as server:
            parsed = browser.parse(browser.dump_dom(f"{server.url}/debug/kv"))
    shown = {
        e["data-part"]: int(e["data-value"])
        for e in parsed.elements
        if e.get("data-figure") == "gpu_part_bytes" and e.get("data-source") == name
    }
    assert shown == r["parts"]
    text = " ".join(parsed.text)
    assert "Where the GPU went" in text and "basis process" in text and UUID in text


def test_a_gpu_that_disappears_reads_truth_unavailable(served) -> None:
    rig, pub, client = served
    rig.standin.lost = pynvml.NVMLError_GpuIsLost()
    pub.publish()
    samples = _scrape(client)
    avail = [s for s in samples if s.name == "kvledger_truth_available"]
    assert {s.labels["truth"]: s.value for s in avail} == {"host_memfd": 1.0, "nvml": 0.0}
    assert not [s for s in samples if s.name.startswith("kvledger_gpu_memory")]
    doc = client.get("/debug/kv").json()
    g = doc["sources"][0]["gpu"]
    assert not g["readable"] and "GpuIsLost" in g["reason"] and g["parts"] == []
    rig.standin.lost = None
    pub.publish()
    assert any(s.name == "kvledger_gpu_memory_bytes" for s in _scrape(client))
