"""How one scrape's series are written: as prometheus-client `Metric` families
(`collect()`), or straight as exposition lines (`render()`), a source's lines kept while its
snapshot is unchanged and written again under its previous layout when only values moved.

`exporter.collector` says what goes in (`SeriesSet.add` and `add_row`, by the metric
table's names); this module only writes it.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from exporter import engine_values
from exporter import metrics as m
from exporter.exposition import Block, LabelMemo, number
from exporter.sources import SourceView

log = logging.getLogger("exporter.collector")


class SeriesSet(Protocol):
    """Series being built for one scrape, added one sample at a time by table name."""

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None: ...

    def add_row(
        self, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
    ) -> None:
        """One series of each metric in `names`, all under `labels`, valued `values`."""


def _add_each(
    fam: SeriesSet, names: tuple[str, ...], labels: dict[str, str], values: Sequence[float]
) -> None:
    for name, value in zip(names, values, strict=True):
        fam.add(name, labels, value)


class MetricFamilies:
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

    def part(self, previous: SourceSeries | None = None) -> SourceSeries:
        return SourceSamples()

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


class SourceSeries:
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


class SourceSamples(SourceSeries):
    """One source's engine series as prometheus-client Samples (collect())."""

    def add(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None:
        self.by_name.setdefault(name, []).append(
            Sample(sample or name, labels, float(value), None, None)
        )


class SampleLines(SourceSeries):
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

    def part(self, previous: SourceSeries | None = None) -> SourceSeries:
        return LayoutLines(self._label_str, previous)

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


class LayoutLines(SourceSeries):
    """One source's engine series as sample lines (render()), in two steps: while
    `_add_engine_series` adds them, each row's names and labels (the shape) and its values
    are recorded; at `done()` each line is its prefix (name and label string, the layout)
    and its value. The layout is written once and reused while the shape is the one of the
    source's previous snapshot, the usual case (a new snapshot of a rank changes values,
    not series): a republished rank then costs a line per value instead of a label string
    and a dictionary per series. The shapes are compared in full (names and label values),
    so a series that changed labels gets a layout of its own."""

    def __init__(self, label_str: LabelMemo, previous: SourceSeries | None) -> None:
        super().__init__()
        self._label_str = label_str
        self._previous = previous if isinstance(previous, LayoutLines) else None
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

    def write(self, values: Sequence[float], previous: LayoutLines | None = None) -> None:
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
