"""A prometheus-client collector: fresh metric families at every scrape, from one snapshot per source.

Like prometheus-client's process collector, it keeps no metric objects between
scrapes: `collect()` reads `Sources` once and builds every family of
`exporter.metrics.METRICS` from those views, so all series of one scrape come
from the same snapshots. The work is O(sources x (families + accounts)); it never
touches slot counts or buffer lists.

A stale source exports only its service metrics (`kvledger_up 0`, its age, epoch,
interval): its figures are no longer true. When two live sources carry the same
engine labels (an engine restarted before the old file was cleaned up), the one
published last provides the engine series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from accounting.buffers import Owner
from accounting.figures import FIGURES
from accounting.ledger import MAP_SECONDS_BUCKETS
from exporter import metrics as m
from exporter.sources import Published, Sources, SourceView

log = logging.getLogger(__name__)
GIB = 2**30


def engine_labels(labels: dict[str, str]) -> dict[str, str]:
    """SGLang's labels of a source, defaults filled in, `dp_rank` only where set."""
    out = {k: str(labels.get(k) or m.ENGINE_LABEL_DEFAULTS[k]) for k in m.ENGINE_LABELS}
    for k in m.OPTIONAL_ENGINE_LABELS:
        if labels.get(k) not in (None, ""):
            out[k] = str(labels[k])
    return out


def live_by_engine(views: Sequence[SourceView]) -> list[SourceView]:
    """Live sources, one per engine label set (the most recently published wins)."""
    best: dict[tuple[tuple[str, str], ...], SourceView] = {}
    for v in views:
        if not v.up:
            continue
        key = tuple(sorted(engine_labels(v.labels).items()))
        other = best.get(key)
        if other is None or v.published.published_at > other.published.published_at:
            if other is not None:
                log.warning(
                    "sources %s and %s carry the same engine labels %s; serving %s",
                    other.source,
                    v.source,
                    dict(key),
                    v.source,
                )
            best[key] = v
    return sorted(best.values(), key=lambda v: v.source)


class _Families:
    """One prometheus-client Metric per table entry, filled sample by sample."""

    def __init__(self) -> None:
        self._by_name = {s.name: Metric(s.family_name, s.help, s.type) for s in m.METRICS}

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        self._by_name[name].samples.append(
            Sample(sample or m.METRIC[name].name, labels, float(value), None, None)
        )

    def extend(self, series: dict[str, list[Sample]]) -> None:
        for name, samples in series.items():
            self._by_name[name].samples.extend(samples)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


class _Series(_Families):
    """Samples of one source's engine series, kept while its snapshot is unchanged."""

    def __init__(self) -> None:
        self.by_name: dict[str, list[Sample]] = {}

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        self.by_name.setdefault(name, []).append(
            Sample(sample or m.METRIC[name].name, labels, float(value), None, None)
        )


EngineCache = dict[str, tuple[Published, dict[str, list[Sample]]]]


class KvLedgerCollector(Collector):
    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._cache: EngineCache = {}
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        views = self.sources.read()
        with self._lock:
            families = build_families(
                views, unreadable=len(self.sources.unreadable), cache=self._cache
            )
        return iter(families)


def build_families(
    views: Sequence[SourceView], *, unreadable: int = 0, cache: EngineCache | None = None
) -> list[Metric]:
    """Every metric family from `views`. With `cache`, a source's engine series are built
    once per published snapshot and reused while it is unchanged."""
    fam = _Families()
    for v in views:
        service = {**engine_labels(v.labels), "source": v.source}
        fam.add("kvledger_up", service, 1 if v.up else 0)
        fam.add("kvledger_snapshot_age_seconds", service, v.age_seconds)
        fam.add("kvledger_snapshot_epoch", service, v.published.epoch)
        fam.add("kvledger_publish_interval_seconds", service, v.published.interval)
    live = live_by_engine(views)
    for v in live:
        hit = cache.get(v.source) if cache is not None else None
        if hit is not None and hit[0] is v.published:
            series = hit[1]
        else:
            built = _Series()
            _add_engine_series(built, v)
            series = built.by_name
            if cache is not None:
                cache[v.source] = (v.published, series)
        fam.extend(series)
    if cache is not None:
        for source in set(cache) - {v.source for v in live}:
            del cache[source]
    fam.add("kvledger_sources_unreadable", {}, unreadable)
    return list(fam)


def _add_engine_series(fam: _Families, v: SourceView) -> None:
    """The engine series of one live source, from its snapshot summary (no buffer rows)."""
    d = v.summary
    eng = engine_labels(v.labels)
    fam.add(m.HEADLINE, eng, d["totals"]["physical_bytes"] / GIB)
    for row in sorted(d["families"], key=lambda r: (r["family"], r["owner"])):
        labels = {**eng, "family": row["family"], "owner": row["owner"]}
        for f in FIGURES:
            fam.add(m.figure_metric(f.name), labels, row[f.name])
    fam.add("kvledger_relation_violations", eng, len(d["violations"]))
    tp = d.get("tp")
    if tp:
        for key in (
            "exchanges_total",
            "page_ops_total",
            "divergences_total",
            "peer_failures_total",
        ):
            fam.add(f"kvledger_tp_{key}", eng, tp[key])
    for r in d["reconciliation"]:
        labels = {**eng, "truth": str(r.get("source", "unknown"))}
        available = bool(r.get("available")) and r.get("device_bytes") is not None
        fam.add("kvledger_truth_available", labels, 1 if available else 0)
        if available:
            fam.add("kvledger_truth_bytes", labels, float(r["device_bytes"]))
            fam.add("kvledger_unattributed_bytes", labels, float(r["unattributed_bytes"]))
    for acc in d["accounts"]:
        labels = {**eng, "family": acc["family"], "pool": acc["pool"]}
        fam.add("kvledger_peak_occupied_slots", labels, acc["peak_occupied_slots"])
        if acc["owner"] != Owner.VMM.value:
            continue
        fam.add("kvledger_pages_mapped_total", labels, acc["pages_mapped_total"])
        fam.add("kvledger_pages_unmapped_total", labels, acc["pages_unmapped_total"])
        fam.add("kvledger_map_calls_total", labels, acc["map_calls"])
        fam.add("kvledger_map_seconds_total", labels, acc["map_seconds_total"])
        fam.add("kvledger_unmap_seconds_total", labels, acc["unmap_seconds_total"])
        fam.add("kvledger_handle_pages", labels, acc["handle_pages"])
        fam.add("kvledger_mapped_pages", labels, acc["mapped_pages"])
        fam.add("kvledger_peak_handle_pages", labels, acc["peak_handle_pages"])
        _add_histogram(fam, "kvledger_map_page_seconds", labels, acc["map_bucket_counts"])


def _add_histogram(
    fam: _Families, name: str, labels: dict[str, str], counts: Sequence[int]
) -> None:
    """Per-bucket counts (the last one past every bound) to cumulative `le` buckets."""
    if len(counts) != len(MAP_SECONDS_BUCKETS) + 1:
        raise ValueError(
            f"{name}: {len(counts)} bucket counts, expected {len(MAP_SECONDS_BUCKETS) + 1}"
        )
    running = 0
    for bound, c in zip((*MAP_SECONDS_BUCKETS, float("inf")), counts, strict=True):
        running += c
        le = floatToGoString(bound)
        fam.add(name, {**labels, "le": le}, running, sample=f"{name}_bucket")
    # No _count (the +Inf bucket is the count) and no _sum (the ledger keeps no sum of the
    # per-page observations): OpenMetrics allows neither without the other.


def registry_for(sources: Sources) -> CollectorRegistry:
    """A registry of its own (no global state) holding only this collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvLedgerCollector(sources))
    return registry
