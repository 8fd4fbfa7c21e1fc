from __future__ import annotations

import math

import pytest
from prometheus_client.core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import Collector, CollectorRegistry

from exporter.collector import registry_for
from exporter.exposition import Renderer, prefers_openmetrics
from exporter.sources import Sources
from tests.ledgers import small_ledger


def _samples(families) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


@pytest.fixture
def registry():
    with small_ledger() as sl:
        sl.allocate(500)
        sl.c4.occupy(3)
        src = Sources()
        src.add_ledger(sl.ledger)
        yield registry_for(src)


def test_both_formats_parse_back_to_the_collected_samples(registry):
    expected = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in registry.collect()
        for s in f.samples
        if s.name != "kvledger_snapshot_age_seconds"
    }
    r = Renderer(registry)
    text, ctype = r.render("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    om, octype = r.render("application/openmetrics-text; version=1.0.0")
    assert octype.startswith("application/openmetrics-text; version=1.0.0")
    for parsed in (parse_text(text.decode()), parse_om(om.decode())):
        got = {k: v for k, v in _samples(parsed).items() if k[0] != "kvledger_snapshot_age_seconds"}
        assert got == expected


def test_label_values_are_escaped_and_names_kept():
    class One(Collector):
        def collect(self):
            m = Metric("weird:name", 'help with "quotes" and \\ and\nnewline', "gauge")
            m.add_sample("weird:name", {"family": 'a"b\\c\nd'}, 1.5)
            m.add_sample("weird:name", {"family": "inf"}, math.inf)
            return [m]

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    for accept in ("text/plain", "application/openmetrics-text"):
        body, _ = Renderer(reg).render(accept)
        parse = parse_om if "openmetrics" in accept else parse_text
        [fam] = list(parse(body.decode()))
        assert fam.name == "weird:name"
        values = {s.labels["family"]: s.value for s in fam.samples}
        assert values == {'a"b\\c\nd': 1.5, "inf": math.inf}


@pytest.mark.parametrize(
    "accept, om",
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("application/openmetrics-text", True),
        ("text/plain;q=0.5,application/openmetrics-text;q=0.4", False),
        ("application/openmetrics-text;q=0", False),
        ("application/openmetrics-text;q=bogus", False),
        ("TEXT/PLAIN, application/openmetrics-text", True),
    ],
)
def test_format_choice(accept, om):
    assert prefers_openmetrics(accept) is om
