from __future__ import annotations

import dataclasses

from accounting.figures import FIGURES
from accounting.ledger import MAP_SECONDS_BUCKETS
from exporter import metrics as m
from exporter.collector import GIB, build_families, registry_for
from exporter.metrics import engine_labels
from exporter.sources import Published, Scan, Sources
from tests.ledgers import small_ledger

ENG = {
    "model_name": "test-model",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}


def _samples(families):
    return [(s.name, s.labels, s.value) for f in families for s in f.samples]


def test_values_come_from_the_snapshot():
    with small_ledger() as sl:
        src = Sources()
        name = src.add_ledger(sl.ledger)
        sl.allocate(600)
        sl.c4.occupy(7)
        reg = registry_for(src)
        snap = sl.ledger.snapshot()
        headline = reg.get_sample_value(m.HEADLINE, ENG)
        assert headline == snap.total("physical_bytes") / GIB
        assert headline is not None and headline > 0
        for (family, owner), figs in snap.rollup("family", "owner").items():
            for f in FIGURES:
                got = reg.get_sample_value(
                    f"sglang:kv_cache_{f.name}", {**ENG, "family": family, "owner": owner}
                )
                assert got == figs[f.name], (family, f.name)
        swa = {**ENG, "family": "swa_kv", "pool": "swa"}
        acc = next(a for a in snap.accounts if a.family == "swa_kv")
        assert reg.get_sample_value("kvledger_pages_mapped_total", swa) == acc.pages_mapped_total
        assert reg.get_sample_value("kvledger_handle_pages", swa) == acc.handle_pages > 0
        assert reg.get_sample_value("kvledger_map_calls_total", swa) == acc.map_calls
        # the histogram is complete: each page id mapped is one observation of its share
        assert (
            reg.get_sample_value("kvledger_map_page_seconds_bucket", {**swa, "le": "+Inf"})
            == reg.get_sample_value("kvledger_map_page_seconds_count", swa)
            == acc.pages_mapped_total
            > 0
        )
        assert reg.get_sample_value("kvledger_map_page_seconds_sum", swa) == acc.map_seconds_total
        # runtime accounts have no page activity series
        c4 = {**ENG, "family": "c4_kv", "pool": "c4"}
        assert reg.get_sample_value("kvledger_pages_mapped_total", c4) is None
        assert reg.get_sample_value("kvledger_peak_occupied_slots", c4) == 7
        assert reg.get_sample_value("kvledger_up", {**ENG, "source": name}) == 1
        assert reg.get_sample_value("kvledger_relation_violations", ENG) == 0
        truth = {**ENG, "truth": "host_memfd"}
        assert reg.get_sample_value("kvledger_truth_bytes", truth) == sl.backend.physical_bytes()
        assert reg.get_sample_value("kvledger_unattributed_bytes", truth) == 0


def test_histogram_buckets_are_cumulative():
    with small_ledger() as sl:
        src = Sources()
        src.add_ledger(sl.ledger)
        sl.allocate(1500)
        [view] = src.read().views
        acc = next(a for a in view.snapshot.accounts if a.family == "swa_kv")
        counts = list(acc.map_bucket_counts)
        counts[0] += 2
        counts[-1] += 3
        fake = dataclasses.replace(acc, map_bucket_counts=tuple(counts))
        snap = dataclasses.replace(
            view.snapshot,
            accounts=tuple(fake if a is acc else a for a in view.snapshot.accounts),
        )
        published = Published.from_snapshot(snap, source="s", pid=1, host="h", sequence=1)
        view = dataclasses.replace(view, published=published)
        samples = [
            (lab["le"], v)
            for name, lab, v in _samples(build_families(Scan((view,))))
            if name == "kvledger_map_page_seconds_bucket" and lab["family"] == "swa_kv"
        ]
        assert [le for le, _ in samples][-1] == "+Inf"
        assert len(samples) == len(MAP_SECONDS_BUCKETS) + 1
        values = [v for _, v in samples]
        assert values == sorted(values)
        assert values[-1] == sum(counts)
        rest = {
            name: v
            for name, lab, v in _samples(build_families(Scan((view,))))
            if name in ("kvledger_map_page_seconds_count", "kvledger_map_page_seconds_sum")
            and lab["family"] == "swa_kv"
        }
        assert rest == {
            "kvledger_map_page_seconds_count": sum(counts),
            "kvledger_map_page_seconds_sum": acc.map_seconds_total,
        }


def test_stale_source_exports_service_metrics_only():
    with small_ledger() as sl:
        src = Sources()
        src.add_ledger(sl.ledger)
        [view] = src.read().views
        stale = dataclasses.replace(view, up=False, stale_reason="pid 1 has exited")
        names = {name for name, _, _ in _samples(build_families(Scan((stale,))))}
        assert names == {
            "kvledger_up",
            "kvledger_snapshot_age_seconds",
            "kvledger_snapshot_epoch",
            "kvledger_publish_interval_seconds",
            "kvledger_publish_errors_total",
            "kvledger_build_info",
            "kvledger_sources_unreadable",
            "kvledger_snapshot_dir_usable",
            "kvledger_source_errors_total",
        }
        up = [v for name, _, v in _samples(build_families(Scan((stale,)))) if name == "kvledger_up"]
        assert up == [0]


def test_two_live_sources_with_the_same_engine_labels_export_no_engine_series():
    """A conflict (exporter.sources): neither source's figures are believed, both are down."""
    with small_ledger(layers=2) as a, small_ledger(layers=3) as b:  # two engines, same labels
        src = Sources()
        src.add_ledger(a.ledger, source="a")
        src.add_ledger(b.ledger, source="b")
        samples = _samples(build_families(src.read()))
        assert [s for s in samples if s[0] == m.HEADLINE] == []
        up = {s[1]["source"]: s[2] for s in samples if s[0] == "kvledger_up"}
        assert up == {"a": 0, "b": 0}


def test_two_live_views_with_the_same_engine_labels_give_the_last_published_one_series():
    """The collector's own guard (live_by_engine), given two views marked live with the same
    engine labels (exporter.sources marks such a pair down as a conflict before it gets
    here): one set of engine series, from the view published last, in either order."""
    with small_ledger(layers=2) as old, small_ledger(layers=3) as new:  # different headlines
        src = Sources()
        src.add_ledger(old.ledger, source="a")
        src.add_ledger(new.ledger, source="b")
        views = {v.source: v for v in src.read().views}
        physical = {s: v.snapshot.total("physical_bytes") for s, v in views.items()}
        assert physical["a"] != physical["b"]
        for winner, loser in (("a", "b"), ("b", "a")):
            at = {winner: 2000.0, loser: 1000.0}
            timed = [
                dataclasses.replace(
                    v, up=True, published=dataclasses.replace(v.published, published_at=at[s])
                )
                for s, v in sorted(views.items(), key=lambda kv: kv[0] == winner)
            ]
            samples = _samples(build_families(Scan(tuple(timed))))
            headline = [v for name, _, v in samples if name == m.HEADLINE]
            assert headline == [physical[winner] / GIB], winner
            swa = [
                v
                for name, labels, v in samples
                if name == "sglang:kv_cache_physical_bytes" and labels["family"] == "swa_kv"
            ]
            assert swa == [views[winner].snapshot.rollup("family")[("swa_kv",)]["physical_bytes"]]
            ups = {labels["source"]: v for name, labels, v in samples if name == "kvledger_up"}
            assert ups == {"a": 1, "b": 1}


def test_every_sample_is_declared_with_its_labels_and_no_total_values():
    with small_ledger({"model_name": "m", "tp_rank": "1", "dp_rank": "2"}) as sl:
        src = Sources()
        src.add_ledger(sl.ledger)
        sl.allocate(300)
        eng = engine_labels(sl.ledger.labels)
        assert eng["dp_rank"] == "2"
        by_sample = {n: spec for spec in m.METRICS for n in spec.sample_names}
        for name, labels, _ in _samples(build_families(src.read())):
            spec = by_sample[name]
            expected = set(spec.labels) | (set(eng) if spec.engine else set())
            if name.endswith("_bucket"):
                expected.add("le")
            assert set(labels) == expected, name
            assert "total" not in labels.values()


def test_render_writes_what_prometheus_clients_own_writer_writes(tmp_path):
    """`KvLedgerCollector.render` (what GET /metrics sends) writes sample lines straight from
    the snapshots; prometheus-client's own text writer over `collect()` must give the same
    families, help, types and samples, on a first scrape, on cache hits, and after a rank
    republished (both formats of render() parse to the same)."""
    import time

    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    from accounting.snapfile.writer import Publisher
    from exporter.collector import KvLedgerCollector

    def parsed(families):
        return sorted(
            (
                f.name,
                f.type,
                f.documentation,
                sorted((s.name, sorted(s.labels.items()), s.value) for s in f.samples),
            )
            for f in families
        )

    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as a,
        small_ledger({"model_name": "m", "tp_rank": "1"}) as b,
        Publisher(a.ledger, tmp_path, interval=3600) as pa,
        Publisher(b.ledger, tmp_path, interval=3600),
    ):
        a.allocate(300)
        b.c4.occupy(5)
        pa.publish()
        now = time.time()
        src = Sources(tmp_path, clock=lambda: now)
        fast, registry = KvLedgerCollector(src), registry_for(src)
        for step in range(3):
            reference = parsed(parse_text(generate_latest(registry).decode()))
            text, _ = fast.render("text/plain")
            om, _ = fast.render("application/openmetrics-text; version=1.0.0")
            assert parsed(parse_text(text.decode())) == reference, step
            assert parsed(parse_om(om.decode())) == parsed(parse_text(text.decode())), step
            assert (
                b"sglang:kv_cache_memory_usage_gb{" in text
                and b"sglang:kv_cache_memory_usage_gb{" in om
            )
            if step == 1:
                a.allocate(10)
                pa.publish()


def test_a_source_that_fails_to_render_is_left_out_named_and_counted(caplog):
    """An exception while building one source's series (here: bucket counts of the wrong
    length, which the histogram refuses) costs that source only: the other source's series
    are served, the failure is logged with its name and counted once per published
    snapshot, whatever the number of renders of it."""
    from exporter.collector import KvLedgerCollector

    with (
        small_ledger({"model_name": "m", "tp_rank": "0"}) as a,
        small_ledger({"model_name": "m", "tp_rank": "1"}) as b,
    ):
        a.allocate(300)
        b.allocate(300)
        src = Sources()
        src.add_ledger(a.ledger, source="good")
        src.add_ledger(b.ledger, source="bad")
        views = {v.source: v for v in src.read().views}

        def broken() -> Published:
            snap = views["bad"].snapshot
            accounts = tuple(
                dataclasses.replace(x, map_bucket_counts=(1, 2)) if x.owner.value == "vmm" else x
                for x in snap.accounts
            )
            return Published.from_snapshot(
                dataclasses.replace(snap, accounts=accounts), source="bad", pid=1, host="h",
                sequence=1,
            )  # fmt: skip

        def scan(bad: Published) -> Scan:
            return Scan((views["good"], dataclasses.replace(views["bad"], published=bad)))

        fast = KvLedgerCollector(src)
        first = scan(broken())
        for accept in ("text/plain", "application/openmetrics-text", "text/plain"):
            text = fast.render(accept, first)[0].decode()
            assert 'source="good"' in text and 'tp_rank="0"' in text
            assert 'source="bad"' not in text and 'tp_rank="1"' not in text
        assert 'kvledger_source_errors_total{reason="render"} 1\n' in text
        assert 'kvledger_source_errors_total{reason="snapshot"} 0\n' in text
        # another snapshot of it: tried again, failed again, counted again
        text = fast.render("text/plain", scan(broken()))[0].decode()
        assert 'kvledger_source_errors_total{reason="render"} 2\n' in text
    logged = [r.getMessage() for r in caplog.records if "source bad left out" in r.getMessage()]
    assert len(logged) == 1 and "render failed" in logged[0]  # the second one held back


def test_the_directory_gauge_is_0_while_no_publisher_can_write_there():
    """kvledger_snapshot_dir_usable is 0 while the scan finds a write problem (a read-only
    mount, no permission, no inode, no room), as for a refused directory (issue 43 finding 4:
    with no inode left it stayed 1)."""
    from accounting.snapfile.reader import FileProblem, FileScan

    def usable(files: FileScan) -> float:
        (got,) = [
            v
            for name, _, v in _samples(build_families(Scan((), files)))
            if name == "kvledger_snapshot_dir_usable"
        ]
        return got

    assert usable(FileScan()) == 1
    for reason in ("read_only", "permission", "no_inodes", "no_space"):
        problem = FileProblem("", reason, "d")
        assert usable(FileScan(problems=(problem,), write_problem=problem)) == 0, reason
    assert usable(FileScan(directory_problem="refused")) == 0
