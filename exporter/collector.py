"""A prometheus-client collector: fresh metric families at every scrape, from one snapshot per source.

Like prometheus-client's process collector, it keeps no metric objects between
scrapes: `collect()` reads `Sources` once and builds every family of
`exporter.metrics.METRICS` from that one `Scan` (the views and what went wrong
reading them), so all series of one scrape come from the same snapshots. The work
is O(sources x (families + accounts)), read from each source's typed `Summary`; it
never touches slot counts or buffer lists itself. A source that a registered engine export
claims (`exporter.engines`: vLLM's) exports that engine's series under its labels instead of
the `sglang:` ones.

A stale source exports only its service metrics (`kvledger_up 0`, its age, epoch,
interval): its figures are no longer true. Two live sources never carry the same
engine labels here: `exporter.sources` marks both down as a conflict. A source whose
series cannot be built (an exception) is left out of the scrape, every series of it,
logged by name and counted (`exporter.failures`); the other sources are served.
"""

from __future__ import annotations

import logging
import operator
import platform
import threading
from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from accounting.buffers import Owner
from accounting.engine_state import REQUEST_BYTES_BUCKETS
from accounting.figures import FIGURES, HOLDER_NAMES
from accounting.gpu_parts import PART_NAMES
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.snapfile.format import counts_of
from accounting.snapfile.summary import Summary
from accounting.tp_status import TP_COUNTERS
from exporter import engine_values, engines
from exporter import metrics as m
from exporter.exposition import LabelMemo, content_type, write_blocks
from exporter.failures import SourceFailures
from exporter.metrics import EngineKey, device_labels, engine_key, engine_labels
from exporter.series import (
    LayoutLines,
    MetricFamilies,
    SampleLines,
    SeriesSet,
    SourceSeries,
)
from exporter.sources import Published, Scan, Sources, SourceView
from exporter.version import VERSION

log = logging.getLogger(__name__)
GIB = 2**30
_FIGURE_METRICS = tuple(m.figure_metric(f.name) for f in FIGURES)
_LE = tuple(floatToGoString(b) for b in (*MAP_SECONDS_BUCKETS, float("inf")))
_REQUEST_LE = tuple(floatToGoString(b) for b in (*REQUEST_BYTES_BUCKETS, float("inf")))
_BUILD_LABELS = {"version": VERSION, "python_version": platform.python_version()}


def live_by_engine(views: Sequence[SourceView]) -> list[SourceView]:
    """Live sources, one per engine label set (the most recently published wins)."""
    best: dict[EngineKey, SourceView] = {}
    for v in views:
        if not v.up:
            continue
        key = engine_key(v.labels)
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


EngineCache = dict[str, tuple[Published, SourceSeries]]


class KvLedgerCollector(Collector):
    """Every metric of `exporter.metrics.METRICS`, read from `sources` at each scrape:
    `render()` for kvledger's /metrics, `collect()` for a prometheus-client registry."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._samples: EngineCache = {}  # for collect()
        self._lines: EngineCache = {}  # for render()
        self._label_str = LabelMemo()
        self._lock = threading.Lock()
        self.failures = SourceFailures(("render",), log)

    def describe(self) -> list[Metric]:
        return []  # built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        """prometheus-client's interface, for a registry of the caller's own.

        The families carry kvledger's names exactly, colons included
        (`sglang:kv_cache_memory_usage_gb`). How the registry is written decides whether
        they survive: prometheus-client's text format 0.0.4 (`generate_latest`,
        `CONTENT_TYPE_LATEST`) keeps them, but its OpenMetrics writer (0.2x, up to at least
        0.26; client_python issue #1177), chosen by `choose_encoder` / `make_asgi_app` /
        `start_http_server` whenever Prometheus asks for OpenMetrics, writes the sample
        lines through its default "underscores" escaping: `sglang_kv_cache_memory_usage_gb`
        under a `# TYPE sglang:kv_cache_memory_usage_gb` header, which Prometheus stores
        under the wrong name. A registry holding this collector must therefore be served
        as text 0.0.4 only (or OpenMetrics only to a scrape that asks for
        `escaping=allow-utf-8`). `render()` (what kvledger's own /metrics sends) needs no
        such care: it writes both formats itself.
        """
        scan = self.sources.read()
        with self._lock:
            families = _build(MetricFamilies(), scan, self._samples, self.failures)
        return iter(families)

    def render(self, accept: str | None, scan: Scan | None = None) -> tuple[bytes, str]:
        """(body, content type) of a scrape: the same series as `collect()` written by
        `exporter.exposition`, without building prometheus-client objects on the way.
        `scan`: what `sources.read()` returned, when the caller read it already."""
        openmetrics, ctype = content_type(accept)
        if scan is None:
            scan = self.sources.read()
        with self._lock:
            self._label_str.turn()  # label sets of sources gone since are dropped
            lines = _build(SampleLines(self._label_str), scan, self._lines, self.failures)
        return write_blocks(lines.blocks(), openmetrics=openmetrics), ctype


_ScrapeT = TypeVar("_ScrapeT", MetricFamilies, SampleLines)


def build_families(scan: Scan, *, cache: EngineCache | None = None) -> list[Metric]:
    """Every metric family from `scan`. With `cache`, a source's engine series are built
    once per published snapshot and reused while it is unchanged."""
    failures = SourceFailures(("render",), log)
    return list(_build(MetricFamilies(), scan, cache, failures))


def _build(
    top: _ScrapeT, scan: Scan, cache: EngineCache | None, failures: SourceFailures
) -> _ScrapeT:
    live = {id(v) for v in live_by_engine(scan.views)}
    for v in scan.views:
        try:
            labels, values = _service_values(v)
            engine = _engine_part(top, v, cache) if id(v) in live else None
        except Exception as e:  # this source only: logged by name, counted, left out
            failures.failed("render", v.source, e, version=v.published)
            continue
        for name, value in zip(_SERVICE_METRICS, values, strict=True):
            top.add(name, labels, value)
        for reason, n in v.published.publish_errors or _NO_ERRORS:
            top.add("kvledger_publish_errors_total", {**labels, "reason": reason}, n)
        if not v.up and v.last_error is not None:
            top.add("kvledger_source_last_error", {**labels, "reason": v.last_error.reason}, 1)
        if engine is not None:
            top.extend(engine.by_name)
    if cache is not None:
        for source in set(cache) - {v.source for v in scan.views if id(v) in live}:
            del cache[source]
    top.add(m.BUILD_INFO, _BUILD_LABELS, 1)
    top.add("kvledger_sources_unreadable", {}, scan.files.unreadable)
    unusable = scan.files.directory_problem or scan.files.write_problem
    top.add("kvledger_snapshot_dir_usable", {}, 0 if unusable else 1)
    for reason, count in sorted(scan.files.error_counts.items()):
        top.add("kvledger_snapshot_file_errors_total", {"reason": reason}, count)
    errors = {**scan.source_errors, **failures.counts}
    for reason in m.SOURCE_ERROR_REASONS:
        top.add("kvledger_source_errors_total", {"reason": reason}, errors.get(reason, 0))
    for reason, n in scan.connections_closed.items():
        top.add("kvledger_connections_closed_total", {"reason": reason}, n)
    return top


def _engine_part(top: _ScrapeT, v: SourceView, cache: EngineCache | None) -> SourceSeries:
    """One live source's engine series, built once per published snapshot with `cache`."""
    hit = cache.get(v.source) if cache is not None else None
    if hit is not None and hit[0] is v.published:
        return hit[1]
    part = top.part(hit[1] if hit is not None else None)
    if isinstance(part, LayoutLines):
        _engine_lines(part, v)
    else:
        _add_engine_series(part, v)
        part.done()
    if cache is not None:
        cache[v.source] = (v.published, part)
    return part


def _engine_lines(part: LayoutLines, v: SourceView) -> None:
    """A source's sample lines: from its columns under its previous layout when its shape is
    unchanged, else through `_add_engine_series` (which also sets the layout's key)."""
    s = v.summary
    eng = None if engines.claiming(s.labels) is not None else _engine_labels(s)
    if eng is not None and part.from_columns(v, eng):
        return
    _add_engine_series(part, v)
    added = part._values
    part.done()
    if eng is not None:
        part.keep_key(v, eng, added)


def _engine_labels(s: Summary) -> dict[str, str]:
    return {**engine_labels(s.labels), **device_labels(s.reconciliation)}


_NO_ERRORS = counts_of({})
_SERVICE_METRICS = (
    "kvledger_up",
    "kvledger_snapshot_age_seconds",
    "kvledger_snapshot_epoch",
    "kvledger_publish_interval_seconds",
)


def _service_values(v: SourceView) -> tuple[dict[str, str], tuple[float, ...]]:
    """A source's own series, live or not (labels, and a value per `_SERVICE_METRICS`): up,
    age, epoch, publish interval."""
    labels = {
        **engine_labels(v.labels),
        **device_labels(v.summary.reconciliation),
        "source": v.source,
    }
    return labels, (1 if v.up else 0, v.age_seconds, v.summary.epoch, v.published.interval)


# Series written a row at a time: the metrics of one label set, each read from the
# attribute of the same place.
_HELD_METRICS = (m.HELD_SLOTS, m.HELD_BYTES)
# each `sglang:kv_cache_<field>`, read from FamilyHeld's field of that name
_EVICTED = engine_values.EVICTED
_EVICTED_METRICS = tuple(f"sglang:kv_cache_{field}" for field in _EVICTED)
_evicted_values = operator.attrgetter(*_EVICTED)
_TP_METRICS = tuple(f"kvledger_tp_{key}" for key in TP_COUNTERS)
_tp_values = operator.attrgetter(*TP_COUNTERS)
_VMM_ACCOUNT = engine_values.VMM_ACCOUNT
_VMM_ACCOUNT_METRICS = tuple(_VMM_ACCOUNT)
_vmm_account_values = operator.attrgetter(*_VMM_ACCOUNT.values())


def _add_engine_series(fam: SeriesSet, v: SourceView) -> None:
    """The engine series of one live source, from its snapshot summary (no buffer rows)."""
    s = v.summary
    eng = _engine_labels(s)
    export = engines.claiming(s.labels)
    if export is not None:  # an engine of its own shape (exporter.engines)
        export.add_series(fam.add, v)
        fam.add("kvledger_relation_violations", eng, len(s.violations))
        return
    fam.add(m.HEADLINE, eng, s.totals.physical_bytes / GIB)
    for row in sorted(s.families, key=lambda r: (r.family, r.owner.value)):
        labels = {**eng, "family": row.family, "owner": row.owner.value}
        fam.add_row(_FIGURE_METRICS, labels, row.figures.values())
    for held in s.holders:
        labels = {**eng, "family": held.family, "owner": held.owner.value}
        for holder, slots, nbytes in zip(
            HOLDER_NAMES, held.slots.values(), held.bytes.values(), strict=True
        ):
            fam.add_row(_HELD_METRICS, {**labels, "holder": holder}, (slots, nbytes))
        fam.add_row(_EVICTED_METRICS, labels, _evicted_values(held))
    engine = s.engine
    if engine is not None:
        fam.add("sglang:kv_cache_retracted_requests_total", eng, engine.retracted_requests_total)
        _add_histogram(
            fam,
            "sglang:kv_cache_request_bytes",
            eng,
            engine.request_bytes_counts,
            engine.request_bytes_sum,
            _REQUEST_LE,
        )
    fam.add("kvledger_relation_violations", eng, len(s.violations))
    tp = s.tp
    if tp is not None:
        fam.add_row(_TP_METRICS, eng, _tp_values(tp))
    for r in s.reconciliation:
        labels = {**eng, "truth": r.source}
        fam.add("kvledger_truth_available", labels, 1 if r.available else 0)
        if r.available and r.device_bytes is not None:
            fam.add("kvledger_truth_bytes", labels, float(r.device_bytes))
            if r.unattributed_bytes is not None:
                fam.add("kvledger_unattributed_bytes", labels, float(r.unattributed_bytes))
        if r.available and r.parts:
            for part in PART_NAMES:
                if part in r.parts:
                    fam.add("kvledger_gpu_memory_bytes", {**eng, "part": part}, r.parts[part])
        if r.available and r.total_bytes is not None:
            fam.add("kvledger_gpu_memory_total_bytes", eng, r.total_bytes)
    for acc in s.accounts:
        labels = {**eng, "family": acc.family, "pool": acc.pool}
        fam.add("kvledger_peak_occupied_slots", labels, acc.peak_occupied_slots)
        if acc.owner is not Owner.VMM:
            continue
        fam.add_row(_VMM_ACCOUNT_METRICS, labels, _vmm_account_values(acc))
        # Each page id observes its operation's seconds / page ids: the observations add up
        # to map_seconds_total (accounting.ledger.MAP_SECONDS_BUCKETS).
        _add_histogram(
            fam, "kvledger_map_page_seconds", labels, acc.map_bucket_counts, acc.map_seconds_total
        )


def _add_histogram(
    fam: SeriesSet,
    name: str,
    labels: dict[str, str],
    counts: Sequence[int],
    total: float,
    bounds: tuple[str, ...] = _LE,
) -> None:
    """Per-bucket counts (the last one past every bound) to cumulative `le` buckets, then
    `_count` (the +Inf bucket) and `_sum` (`total`, the sum of the observations)."""
    if len(counts) != len(bounds):
        raise ValueError(f"{name}: {len(counts)} bucket counts, expected {len(bounds)}")
    running = 0
    sample = f"{name}_bucket"
    for le, c in zip(bounds, counts, strict=True):
        running += c
        fam.add(name, {**labels, "le": le}, running, sample=sample)
    fam.add(name, labels, running, sample=f"{name}_count")
    fam.add(name, labels, total, sample=f"{name}_sum")


def registry_for(sources: Sources) -> CollectorRegistry:
    """A registry of its own (no global state) holding only this collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvLedgerCollector(sources))
    return registry
