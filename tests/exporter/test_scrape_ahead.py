"""Issue 43 finding 7: with the background scan on, a scrape neither parses the ranks'
newest snapshots nor renders them. Its own scan keeps a version parsed less than two scan
intervals ago, and it is sent the bodies the background scan built when it finds the same
snapshots."""

from __future__ import annotations

from accounting.snapfile.writer import Publisher
from exporter.collector import KvLedgerCollector
from exporter.serving import MetricsBodies
from exporter.sources import Sources
from tests.ledgers import small_ledger

PROMETHEUS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def test_a_scrape_keeps_a_young_version_and_parses_a_new_source(tmp_path):
    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as sl,
        Publisher(sl.ledger, tmp_path, interval=1000) as pub,
        Sources(tmp_path) as src,
    ):
        pub.publish()
        src.start_scanning(60, max_age=120)  # its first scan comes after the test: none runs
        [v1] = src.read().views  # new: parsed by the scrape itself
        pub.publish()  # a newer version, not parsed by any background scan yet
        [kept] = src.read().views
        assert kept.published is v1.published  # the young version, not parsed again
        background = src._read(0.0)  # what the background scan reads
        [v2] = background.views
        assert v2.published is not v1.published and v2.published.sequence > v1.published.sequence
        with (
            small_ledger({"model_name": "other", "tp_rank": "0"}) as other,
            Publisher(other.ledger, tmp_path, interval=1000) as new,
        ):
            new.publish()
            sources = {v.source for v in src.read().views}
            assert new.source in sources  # a new source is parsed at once


def test_without_a_max_age_a_scrape_serves_each_file_as_it_is(tmp_path):
    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as sl,
        Publisher(sl.ledger, tmp_path, interval=1000) as pub,
        Sources(tmp_path) as src,
    ):
        pub.publish()
        src.start_scanning(60)  # the default: no max age
        [v1] = src.read().views
        pub.publish()
        [v2] = src.read().views
        assert v2.published.sequence > v1.published.sequence  # the newest, parsed at once


def test_a_scrape_is_sent_the_bodies_built_ahead_for_the_same_snapshots(tmp_path):
    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as sl,
        Publisher(sl.ledger, tmp_path, interval=1000) as pub,
        Sources(tmp_path) as src,
    ):
        pub.publish()
        bodies = MetricsBodies(KvLedgerCollector(src))
        key = bodies.want(PROMETHEUS, True)
        bodies.ahead(src.read())
        built = bodies._ahead[1][key]
        assert bodies.prepare(src.read())[key] is built  # same snapshots: not rendered
        pub.publish()
        again = bodies.prepare(src.read())[key]  # a new snapshot: rendered
        assert again is not built and again[0] != built[0]
