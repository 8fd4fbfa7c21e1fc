from __future__ import annotations

import math

import pytest
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter import metrics as m
from exporter.collector import KvLedgerCollector, registry_for
from exporter.exposition import LabelMemo, number, prefers_openmetrics, write_blocks
from exporter.sources import Sources
from tests.ledgers import small_ledger


def _samples(families) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


AGE = "kvledger_snapshot_age_seconds"  # moves between two reads


@pytest.fixture
def sources():
    with small_ledger() as sl:
        sl.allocate(500)
        sl.c4.occupy(3)
        src = Sources()
        src.add_ledger(sl.ledger)
        yield src


def test_both_formats_parse_back_to_the_collected_samples(sources):
    expected = {k: v for k, v in _samples(registry_for(sources).collect()).items() if k[0] != AGE}
    collector = KvLedgerCollector(sources)
    text, ctype = collector.render("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    om, octype = collector.render("application/openmetrics-text; version=1.0.0")
    assert octype.startswith("application/openmetrics-text; version=1.0.0")
    for parsed in (parse_text(text.decode()), parse_om(om.decode())):
        got = {k: v for k, v in _samples(parsed).items() if k[0] != AGE}
        assert got == expected


def test_label_values_are_escaped_and_names_kept():
    label_str = LabelMemo()
    weird = 'a"b\\c\nd'
    lines = [
        f"weird:name{label_str({'family': weird})} {number(1.5)}\n",
        f"weird:name{label_str({'family': 'inf'})} {number(math.inf)}\n",
    ]
    block = ("weird:name", "gauge", 'help with "quotes" and \\ and\nnewline', lines)
    for openmetrics, parse in ((False, parse_text), (True, parse_om)):
        body = write_blocks([block], openmetrics=openmetrics)
        [fam] = list(parse(body.decode()))
        assert fam.name == "weird:name"
        assert fam.documentation == 'help with "quotes" and \\ and\nnewline'
        values = {s.labels["family"]: s.value for s in fam.samples}
        assert values == {weird: 1.5, "inf": math.inf}


def test_a_registry_served_as_text_keeps_every_name(sources):
    """What collect()'s docstring tells a registry to do: prometheus-client's text writer."""
    body = generate_latest(registry_for(sources)).decode()
    names = {s.name for f in parse_text(body) for s in f.samples}
    assert m.HEADLINE in names
    declared = {n for spec in m.METRICS for n in spec.sample_names}
    assert names <= declared


def test_prometheus_clients_openmetrics_writer_still_rewrites_colons(sources):
    """Why collect()'s docstring warns: client_python's OpenMetrics writer (issue #1177).
    When this fails, upstream fixed it and the warning can go."""
    encoder, _ = choose_encoder("application/openmetrics-text; version=1.0.0")
    body = encoder(registry_for(sources)).decode()
    assert f"# TYPE {m.HEADLINE} gauge" in body
    assert m.HEADLINE.replace(":", "_") + "{" in body
    assert m.HEADLINE + "{" not in body


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


def test_the_label_memo_tells_apart_every_label_set_its_flat_keys_could_confuse() -> None:
    """The memo's key is the names then the values, in one tuple: sets that share their
    strings in another arrangement, or differ only in length, each get their own text."""
    memo = LabelMemo()
    sets = [
        {"a": "b", "c": "d"},
        {"a": "c", "b": "d"},
        {"a": "b"},
        {"a": "b", "c": "d", "e": ""},
        {"c": "d", "a": "b"},  # the first set, inserted in another order: the same text
        {},
    ]
    want = ['{a="b",c="d"}', '{a="c",b="d"}', '{a="b"}', '{a="b",c="d",e=""}', '{a="b",c="d"}', ""]
    for _ in range(2):  # computed, then memoised
        assert [memo(s) for s in sets] == want
    memo.turn()
    assert [memo(s) for s in sets] == want  # from the older half
