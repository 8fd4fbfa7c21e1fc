"""The "Where the GPU went" row and the documented join with dcgm-exporter, evaluated by Debian's
Prometheus scraping a real uvicorn serving a ledger whose NVML truth splits the GPU into parts
(tests/accounting/gpu_rig.py: CPU-only, NVML at accounting.nvml's boundary) and a stand-in for
dcgm-exporter serving `DCGM_FI_DEV_FB_USED` for the same GPU, labelled as dcgm-exporter does."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from exporter import metrics as m
from exporter.app import create_app
from exporter.sources import Sources
from kvledger.tools.dashboards.promql import metric_names
from tests.accounting.gpu_rig import MiB, gpu_rig
from tests.accounting.nvml_standin import INDEX, UUID
from tests.kvledger.tools.dashboards import names
from tests.kvledger.tools.dashboards.test_live import substitute
from tests.servers import PROMETHEUS, Prometheus, UvicornThread, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="needs Debian's prometheus"),
]
DOCS = Path(__file__).resolve().parents[4] / "docs" / "metrics.md"


def dcgm_app(fb_used_bytes):
    """dcgm-exporter's /metrics for one GPU: FB_USED in MiB, with its labels."""

    async def app(scope, receive, send):
        assert scope["type"] == "http"
        body = (
            "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n"
            "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
            f'DCGM_FI_DEV_FB_USED{{gpu="{INDEX}",UUID="{UUID}",device="nvidia{INDEX}",'
            f'modelName="NVIDIA H200",Hostname="gpu-node"}} {fb_used_bytes() // MiB}\n'
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def _joins() -> list[str]:
    text = DOCS.read_text(encoding="utf-8").split("## Joining dcgm-exporter", 1)[1]
    block = re.search(r"```promql\n(.*?)```", text, re.S)
    assert block, "docs/metrics.md: no PromQL block under 'Joining dcgm-exporter'"
    queries, current = [], []  # type: ignore[var-annotated]
    for line in block.group(1).splitlines():
        if line.startswith("#") or not line.strip():
            if current:
                queries.append(" ".join(current))
                current = []
            continue
        current.append(line.strip())
    if current:
        queries.append(" ".join(current))
    return queries


def test_gpu_row_and_the_dcgm_join_against_prometheus(monkeypatch) -> None:
    with gpu_rig(monkeypatch) as rig, Sources() as src:
        rig.sl.allocate(1200)
        rig.torch_mem.add((1, 0), 40 * MiB, 33 * MiB)  # a captured graph's pool
        src.add_ledger(rig.sl.ledger)
        r, _ = rig.parts()
        used = r["detail"]["used_bytes"]

        def fb_used() -> int:
            return rig.parts()[0]["detail"]["used_bytes"]

        with (
            UvicornThread(create_app(src)) as kv,
            UvicornThread(dcgm_app(fb_used)) as dcgm,
            Prometheus([kv.url.removeprefix("http://"), dcgm.url.removeprefix("http://")]) as prom,
        ):
            wait_until(
                lambda: (
                    prom.query("kvledger_gpu_memory_bytes") and prom.query("DCGM_FI_DEV_FB_USED")
                ),
                30,
                "both targets scraped",
                interval=0.2,
            )
            values = {
                "instance": kv.url.removeprefix("http://"),
                "model_name": "test-model",
                "tp_rank": "0",
                "family": ".*",
            }
            gpu_panels = [
                (title, expr)
                for title, expr in names.panel_queries()
                if metric_names(expr) & m.GPU_ONLY
            ]
            assert len(gpu_panels) == 3, gpu_panels
            results = {expr: prom.query(substitute(expr, values)) for _, expr in gpu_panels}
            assert all(results.values()), results
            stacked = next(res for expr, res in results.items() if expr.startswith("sum by (part)"))
            got = {s["metric"]["part"]: float(s["value"][1]) for s in stacked}
            assert got == {k: float(v) for k, v in r["parts"].items()}
            assert sum(got.values()) == used
            total = next(res for expr, res in results.items() if expr.startswith("max("))
            assert float(total[0]["value"][1]) == rig.standin.total

            # every kvledger series of this source joins dcgm-exporter's on UUID
            series = prom.series(f'{{instance="{values["instance"]}", UUID="{UUID}"}}')
            assert {s["__name__"] for s in series} >= {m.HEADLINE, "kvledger_up"}
            assert all(s["gpu"] == str(INDEX) for s in series)

            diff, share = (prom.query(q) for q in _joins())
            assert len(diff) == 1 and abs(float(diff[0]["value"][1])) < MiB  # FB_USED is in MiB
            assert share[0]["metric"]["Hostname"] == "gpu-node"
            kv_share = r["parts"]["kv"] / ((used // MiB) * MiB)
            assert float(share[0]["value"][1]) == pytest.approx(kv_share)
