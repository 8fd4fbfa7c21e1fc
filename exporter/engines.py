"""Engine exports: how a source of one engine's own shape reaches the collector and /debug/kv.

A source in SGLang's shape (the metric contract's `sglang:` names, every figure per family)
is what the exporter serves by itself. An engine whose files carry another shape (vLLM's
workers and engine cores: per KV-cache group, under vLLM's labels) brings an `EngineExport`
from its own room (`kvledger/engines/<engine>/`) and registers it here, the way
node_exporter's collectors register themselves: the exporter knows this interface and
nothing of the engine. Whoever runs the exporter registers the engines it serves
(`kvledger serve` registers every engine kvledger knows); a source no registered export
claims is served in SGLang's shape.

Registering an export adds its metrics to the exporter's one table (`exporter.metrics`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from exporter import metrics

if TYPE_CHECKING:
    from exporter.sources import SourceView


class AddSample(Protocol):
    """Adds one sample: metric name (as declared), labels, value; `sample` names a
    histogram's `_bucket`, `_count` or `_sum` sample (the metric's own name otherwise)."""

    def __call__(
        self, name: str, labels: dict[str, str], value: float, *, sample: str | None = None
    ) -> None: ...


class EngineExport(Protocol):
    """One engine's series and /debug/kv section for the sources it claims."""

    # The key of its section in a /debug/kv source ("vllm"); a name of lowercase letters.
    name: str
    # Its metrics, each `engine=False` (they carry the engine's own labels, in `labels`).
    metrics: tuple[metrics.MetricSpec, ...]
    # The pydantic model of its /debug/kv section, and that section's description.
    debug_model: type[Any]
    debug_description: str
    # Whether a source's slot figures add up over its families (one kind of slot). False
    # where they do not (vLLM: blocks in one family, tokens or states in the others): the
    # /debug/kv totals then carry no slot figures (null).
    slots_add_up: bool

    def claims(self, labels: Mapping[str, str]) -> bool:
        """Whether a source with these ledger labels is this engine's."""

    def add_series(self, add: AddSample, view: SourceView) -> None:
        """The source's series, through `add` (the collector's)."""

    def debug(self, view: SourceView) -> Any:
        """The source's /debug/kv section (a `debug_model`)."""


_lock = threading.Lock()
_exports: tuple[EngineExport, ...] = ()  # rebound under the lock, read without it


def register(export: EngineExport) -> None:
    """Serve the sources `export` claims. Registering the same export again does nothing;
    another export under a taken name, or a metric name already declared, raises."""
    if not (export.name.isascii() and export.name.isalpha() and export.name.islower()):
        raise ValueError(f"engine export name {export.name!r}: expected lowercase letters")
    global _exports
    with _lock:
        known = next((e for e in _exports if e.name == export.name), None)
        if known is export:
            return
        if known is not None:
            raise ValueError(f"engine export {export.name!r} is registered already")
        for spec in export.metrics:
            if spec.engine:
                raise ValueError(
                    f"metric {spec.name!r} of engine export {export.name!r}: an engine "
                    "export's metric carries the engine's own labels (engine=False)"
                )
        metrics.register(export.metrics)
        _exports = (*_exports, export)


def registered() -> tuple[EngineExport, ...]:
    """The registered exports, in the order they were registered."""
    return _exports


def claiming(labels: Mapping[str, str]) -> EngineExport | None:
    """The export that claims a source with these labels, or None (SGLang's shape)."""
    for export in _exports:
        if export.claims(labels):
            return export
    return None
