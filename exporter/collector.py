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
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
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
from exporter.exposition import Block, LabelMemo, content_type, number, write_blocks
from exporter.failures import SourceFailures
from exporter.metrics import EngineKey, device_labels, engine_key, engine_labels
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


class _SeriesSet(Protocol):
    """Series being built for one scrape, added one sample at a time by table name."""

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None: ...

    def add_row(
        self, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
    ) -> None:
        """One series of each metric in `names`, all under `labels`, valued `values`."""


def _add_each(
    fam: _SeriesSet, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
) -> None:
    for name, value in zip(names, values, strict=True):
        fam.add(name, labels, value)


class _MetricFamilies:
    """A whole scrape as prometheus-client Metric families, one per table entry (collect())."""

    def __init__(self) -> None:
        self._by_name = {s.name: Metric(s.family_name, s.help, s.type) for s in m.METRICS}

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        self._by_name[name].samples.append(Sample(sample or name, labels, float(value), None, None))

    def add_row(
        self, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
    ) -> None:
        _add_each(self, names, labels, values)

    def extend(self, series: dict[str, list[Any]]) -> None:
        for name, samples in series.items():
            self._by_name[name].samples.extend(samples)

    def part(self, previous: _SourceSeries | None = None) -> _SourceSeries:
        return _SourceSamples()

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


class _SourceSeries:
    """One source's engine series, by table name: kept while its snapshot is unchanged."""

    def __init__(self) -> None:
        self.by_name: dict[str, list[Any]] = {}

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        raise NotImplementedError

    def add_row(
        self, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
    ) -> None:
        _add_each(self, names, labels, values)

    def done(self) -> None:
        """Called once every series was added."""


class _SourceSamples(_SourceSeries):
    """One source's engine series as prometheus-client Samples (collect())."""

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        self.by_name.setdefault(name, []).append(
            Sample(sample or name, labels, float(value), None, None)
        )


class _SampleLines(_SourceSeries):
    """Exposition sample lines by table name, written straight away (render()): one source's
    engine series, or a whole scrape, which `blocks()` hands to the writer."""

    def __init__(self, label_str: LabelMemo) -> None:
        super().__init__()
        self._label_str = label_str
        # The series of one row share one labels dict: written once per row, not per series.
        self._last: tuple[dict[str, str] | None, str] = (None, "")

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        last, text = self._last
        if labels is not last:
            text = self._label_str(labels)
            self._last = (labels, text)
        line = f"{sample or name}{text} {number(value)}\n"
        lines = self.by_name.get(name)
        if lines is None:
            self.by_name[name] = [line]
        else:
            lines.append(line)

    def extend(self, series: dict[str, list[Any]]) -> None:
        by_name = self.by_name
        for name, lines in series.items():
            by_name.setdefault(name, []).extend(lines)

    def part(self, previous: _SourceSeries | None = None) -> _SourceSeries:
        return _LayoutLines(self._label_str, previous)

    def blocks(self) -> list[Block]:
        return [(s.family_name, s.type, s.help, self.by_name.get(s.name, ())) for s in m.METRICS]


_EXACT = 2**53  # ints below this are written as they are (exposition.number)
# What was added, in order: (metric names, sample name of a lone metric or None, labels).
Shape = list[tuple[tuple[str, ...], "str | None", dict[str, str]]]


class Layout(NamedTuple):
    """How a shape's values become lines: the series ordered by metric (each metric's in the
    order added), their line prefixes (name and label string) in that order, `pick` taking
    the values into it, and each metric's span of the lines."""

    prefixes: list[str]
    pick: Callable[[Sequence[float]], Sequence[float]]
    spans: tuple[tuple[str, int, int], ...]


class _LayoutLines(_SourceSeries):
    """One source's engine series as sample lines (render()), in two steps: while
    `_add_engine_series` adds them, each row's names and labels (the shape) and its values
    are recorded; at `done()` each line is its prefix (name and label string, the layout)
    and its value. The layout is written once and reused while the shape is the one of the
    source's previous snapshot, the usual case (a new snapshot of a rank changes values,
    not series): a republished rank then costs a line per value instead of a label string
    and a dictionary per series. The shapes are compared in full (names and label values),
    so a series that changed labels gets a layout of its own."""

    def __init__(self, label_str: LabelMemo, previous: _SourceSeries | None) -> None:
        super().__init__()
        self._label_str = label_str
        self._previous = previous if isinstance(previous, _LayoutLines) else None
        self.shape: Shape = []
        self._values: list[float] = []
        self.layout = _NO_LAYOUT
        self._picked: Sequence[float] | None = None  # the values written, in line order
        # What decides the shape (`engine_values.shape_key`), when the layout can take values
        # read from the columns; None when it cannot (a vLLM source, or values that differ).
        self.key: Hashable | None = None

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        self.shape.append(((name,), sample, labels))
        self._values.append(value)

    def add_row(
        self, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
    ) -> None:
        if len(names) != len(values):
            raise ValueError(f"{names[:1]}...: {len(values)} values for {len(names)} metrics")
        self.shape.append((names, None, labels))
        self._values.extend(values)

    def done(self) -> None:
        previous, self._previous = self._previous, None
        if previous is not None and previous.shape == self.shape:
            self.layout = previous.layout
        else:
            self.layout = _layout(self.shape, self._label_str)
        self.write(self._values, previous)
        self._values = []

    def write(self, values: Sequence[float], previous: _LayoutLines | None = None) -> None:
        """The lines of `values` (in the order added) under this part's layout. A metric
        whose values are those of `previous` (the source's last snapshot, same layout) keeps
        its lines: equal values are written alike (`exposition.number`: 1 and 1.0 both "1"),
        and a republished rank changes the values of a few metrics, not of all."""
        prefixes, pick, spans = self.layout
        picked = self._picked = pick(values)
        before = (
            previous._picked if previous is not None and previous.layout is self.layout else None
        )
        if before is None or len(before) != len(picked):
            lines = _lines(prefixes, picked)
            self.by_name = {name: lines[start:end] for name, start, end in spans}
            return
        kept = previous.by_name if previous is not None else {}
        by_name = self.by_name = {}
        for name, start, end in spans:
            these, those = picked[start:end], before[start:end]
            if these == those:
                by_name[name] = kept[name]
            else:  # only the lines whose values changed (a held row: 1 of a family's 4)
                by_name[name] = _changed_lines(prefixes[start:end], these, those, kept[name])

    def from_columns(self, v: SourceView, eng: dict[str, str]) -> bool:
        """One source's lines written from its summary's columns (`exporter.engine_values`)
        under the previous snapshot's layout, when the shape is that one's: True if done."""
        previous = self._previous
        if previous is None or previous.key is None:
            return False
        try:
            key = engine_values.shape_key(v.summary, eng)
            values = engine_values.values(v.summary) if key == previous.key else None
        except Exception:  # the columns cannot say: `_add_engine_series` (which names why)
            log.debug("source %s: series from the columns failed", v.source, exc_info=True)
            return False
        if values is None:
            return False
        self._previous = None
        self.layout, self.key = previous.layout, key
        self.write(values, previous)
        return True

    def keep_key(self, v: SourceView, eng: dict[str, str], added: list[float]) -> None:
        """After a build through `_add_engine_series` (values `added`): this layout's shape
        key, kept only if the columns' values are those very values."""
        try:
            if engine_values.same(engine_values.values(v.summary), added):
                self.key = engine_values.shape_key(v.summary, eng)
        except Exception:  # no key: this source's layouts keep being built the other way
            log.debug("source %s: no series from the columns", v.source, exc_info=True)


def _lines(prefixes: Sequence[str], values: Sequence[float]) -> list[str]:
    """Each prefix (name and labels) with its value, a line each."""
    # Most values are small ints, written as str() writes them (number() says the same).
    return [
        f"{p}{v}\n" if type(v) is int and -_EXACT < v < _EXACT else f"{p}{number(v)}\n"
        for p, v in zip(prefixes, values, strict=True)
    ]


def _changed_lines(
    prefixes: Sequence[str], values: Sequence[float], before: Sequence[float], lines: list[str]
) -> list[str]:
    """`lines` (of the values `before`) with the lines of the values that differ written
    again: equal values are written alike (`exposition.number`)."""
    return [
        line if v == b else _lines((p,), (v,))[0]
        for p, v, b, line in zip(prefixes, values, before, lines, strict=True)
    ]


def _layout(shape: Shape, label_str: LabelMemo) -> Layout:
    by_metric: dict[str, list[int]] = {}
    series: list[str] = []  # each series' line prefix, in the order added
    for names, sample, labels in shape:
        text = label_str(labels)
        for name in names:
            by_metric.setdefault(name, []).append(len(series))
            series.append(f"{sample or name}{text} ")
    order = [i for where in by_metric.values() for i in where]
    spans, start = [], 0
    for name, where in by_metric.items():
        spans.append((name, start, start + len(where)))
        start += len(where)
    # zero or one series: already in order (an itemgetter of one index returns no tuple)
    pick: Callable[[Sequence[float]], Sequence[float]] = (
        operator.itemgetter(*order) if len(order) > 1 else _as_is
    )
    return Layout([series[i] for i in order], pick, tuple(spans))


def _as_is(values: Sequence[float]) -> Sequence[float]:
    return values


_NO_LAYOUT = Layout([], _as_is, ())


EngineCache = dict[str, tuple[Published, _SourceSeries]]


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
            families = _build(_MetricFamilies(), scan, self._samples, self.failures)
        return iter(families)

    def render(self, accept: str | None, scan: Scan | None = None) -> tuple[bytes, str]:
        """(body, content type) of a scrape: the same series as `collect()` written by
        `exporter.exposition`, without building prometheus-client objects on the way.
        `scan`: what `sources.read()` returned, when the caller read it already."""
        openmetrics, ctype = content_type(accept)
        if scan is None:
            scan = self.sources.read()
        with self._lock:
            lines = _build(_SampleLines(self._label_str), scan, self._lines, self.failures)
        return write_blocks(lines.blocks(), openmetrics=openmetrics), ctype


_ScrapeT = TypeVar("_ScrapeT", _MetricFamilies, _SampleLines)


def build_families(scan: Scan, *, cache: EngineCache | None = None) -> list[Metric]:
    """Every metric family from `scan`. With `cache`, a source's engine series are built
    once per published snapshot and reused while it is unchanged."""
    failures = SourceFailures(("render",), log)
    return list(_build(_MetricFamilies(), scan, cache, failures))


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


def _engine_part(top: _ScrapeT, v: SourceView, cache: EngineCache | None) -> _SourceSeries:
    """One live source's engine series, built once per published snapshot with `cache`."""
    hit = cache.get(v.source) if cache is not None else None
    if hit is not None and hit[0] is v.published:
        return hit[1]
    part = top.part(hit[1] if hit is not None else None)
    if isinstance(part, _LayoutLines):
        _engine_lines(part, v)
    else:
        _add_engine_series(part, v)
        part.done()
    if cache is not None:
        cache[v.source] = (v.published, part)
    return part


def _engine_lines(part: _LayoutLines, v: SourceView) -> None:
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


def _add_engine_series(fam: _SeriesSet, v: SourceView) -> None:
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
    fam: _SeriesSet,
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
