"""exporter.engines: an engine export registers its metrics once, claims its sources, and
a clash or a metric in SGLang's shape is refused with nothing registered."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from pydantic import BaseModel

from exporter import engines
from exporter import metrics as m


class _Section(BaseModel):
    role: str


class _Export:
    def __init__(self, name: str, engine_type: str, metric: str, *, engine: bool = False):
        self.name = name
        self.engine_type = engine_type
        self.metrics: tuple[m.MetricSpec, ...] = (
            m.MetricSpec(metric, "gauge", "a test metric", ("model_name",), engine=engine),
        )
        self.debug_model = _Section
        self.debug_description = "a test section"
        self.slots_add_up = True

    def claims(self, labels: Mapping[str, str]) -> bool:
        return labels.get("engine_type") == self.engine_type

    def add_series(self, add: Any, view: Any) -> None:
        add(self.metrics[0].name, {"model_name": "x"}, 1.0)

    def debug(self, view: Any) -> _Section:
        return _Section(role=self.engine_type)


@pytest.fixture(autouse=True)
def _registry_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test registers into a copy: the process's table is as it was afterwards."""
    monkeypatch.setattr(engines, "_exports", engines._exports)
    monkeypatch.setattr(m, "METRICS", m.METRICS)
    monkeypatch.setattr(m, "METRIC", dict(m.METRIC))
    yield


def test_registering_adds_its_metrics_once_and_claims_its_sources() -> None:
    before = len(m.METRICS)
    a = _Export("alpha", "alpha_worker", "kvledger_alpha_x")
    engines.register(a)
    engines.register(a)  # again: nothing changes
    assert len(m.METRICS) == before + 1 and m.METRIC["kvledger_alpha_x"] is a.metrics[0]
    assert "kvledger_alpha_x" in m.series_names()
    assert engines.registered()[-1] is a
    assert engines.claiming({"engine_type": "alpha_worker"}) is a
    assert engines.claiming({"engine_type": "unified"}) is None  # SGLang's shape


def test_the_first_export_that_claims_a_source_serves_it() -> None:
    a = _Export("alpha", "shared", "kvledger_alpha_x")
    b = _Export("beta", "beta_worker", "kvledger_beta_x")
    engines.register(a)
    engines.register(b)
    assert engines.claiming({"engine_type": "beta_worker"}) is b
    assert engines.claiming({"engine_type": "shared"}) is a


@pytest.mark.parametrize(
    ("export", "message"),
    [
        (_Export("Alpha", "t", "kvledger_alpha_x"), "expected lowercase letters"),
        (_Export("alpha", "t", "kvledger_up"), "declared already"),
        (_Export("alpha", "t", "kvledger_alpha_x", engine=True), "engine=False"),
    ],
)
def test_a_bad_export_is_refused_with_nothing_registered(export: _Export, message: str) -> None:
    before, exports = m.METRICS, engines.registered()
    with pytest.raises(ValueError, match=message):
        engines.register(export)
    assert (m.METRICS, engines.registered()) == (before, exports)


def test_another_export_under_a_taken_name_is_refused() -> None:
    engines.register(_Export("alpha", "t", "kvledger_alpha_x"))
    with pytest.raises(ValueError, match="registered already"):
        engines.register(_Export("alpha", "u", "kvledger_alpha_y"))
    assert "kvledger_alpha_y" not in m.METRIC
