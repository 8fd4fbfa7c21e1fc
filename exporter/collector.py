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
from collections.abc import Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from accounting.buffers import Owner
from accounting.figures import FIGURES
from accounting.ledger import MAP_SECONDS_BUCKETS
from exporter import metrics as m
from exporter.sources import Sources, SourceView

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
        spec = m.METRIC[name]
        self._by_name[name].add_sample(sample or spec.name, labels, float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


class KvLedgerCollector(Collector):
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def describe(self) -> list[Metric]:
        return []  # built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        return iter(build_families(self.sources.read(), unreadable=len(self.sources.unreadable)))


def build_families(views: Sequence[SourceView], *, unreadable: int = 0) -> list[Metric]:
    fam = _Families()
    for v in views:
        service = {**engine_labels(v.labels), "source": v.source}
        fam.add("kvledger_up", service, 1 if v.up else 0)
        fam.add("kvledger_snapshot_age_seconds", service, v.age_seconds)
        fam.add("kvledger_snapshot_epoch", service, v.snapshot.epoch)
        fam.add("kvledger_publish_interval_seconds", service, v.published.interval)
    for v in live_by_engine(views):
        _add_engine_series(fam, v)
    fam.add("kvledger_sources_unreadable", {}, unreadable)
    return list(fam)


def _add_engine_series(fam: _Families, v: SourceView) -> None:
    snap = v.snapshot
    eng = engine_labels(v.labels)
    fam.add(m.HEADLINE, eng, snap.total("physical_bytes") / GIB)
    for (family, owner), figures in sorted(snap.rollup("family", "owner").items()):
        labels = {**eng, "family": family, "owner": owner}
        for f in FIGURES:
            fam.add(m.figure_metric(f.name), labels, figures[f.name])
    fam.add("kvledger_relation_violations", eng, len(snap.violations))
    for r in snap.reconciliation:
        labels = {**eng, "truth": str(r.get("source", "unknown"))}
        available = bool(r.get("available")) and r.get("device_bytes") is not None
        fam.add("kvledger_truth_available", labels, 1 if available else 0)
        if available:
            fam.add("kvledger_truth_bytes", labels, float(r["device_bytes"]))
            fam.add("kvledger_unattributed_bytes", labels, float(r["unattributed_bytes"]))
    for acc in snap.accounts:
        labels = {**eng, "family": acc.family, "pool": acc.pool}
        fam.add("kvledger_peak_occupied_slots", labels, acc.peak_occupied_slots)
        if acc.owner is not Owner.VMM:
            continue
        fam.add("kvledger_pages_mapped_total", labels, acc.pages_mapped_total)
        fam.add("kvledger_pages_unmapped_total", labels, acc.pages_unmapped_total)
        fam.add("kvledger_map_calls_total", labels, acc.map_calls)
        fam.add("kvledger_map_seconds_total", labels, acc.map_seconds_total)
        fam.add("kvledger_unmap_seconds_total", labels, acc.unmap_seconds_total)
        fam.add("kvledger_handle_pages", labels, acc.handle_pages)
        fam.add("kvledger_mapped_pages", labels, acc.mapped_pages)
        fam.add("kvledger_peak_handle_pages", labels, acc.peak_handle_pages)
        _add_histogram(fam, "kvledger_map_page_seconds", labels, acc.map_bucket_counts)


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
    fam.add(name, labels, running, sample=f"{name}_count")


def registry_for(sources: Sources) -> CollectorRegistry:
    """A registry of its own (no global state) holding only this collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvLedgerCollector(sources))
    return registry
