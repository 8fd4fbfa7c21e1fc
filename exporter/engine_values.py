"""A source's engine series read straight from its summary's columns: values and shape.

`exporter.collector._add_engine_series` says what a source exports, series by series,
from the summary's records. A republished rank keeps its series and changes their
values, so the collector keeps each source's layout (line prefixes, by metric) and
needs only the new values in the order that function adds them. `values(summary)`
gives them from the columns (`accounting.snapfile.summary`: families, holders and
accounts a column at a time, no record built), and `shape_key(summary, eng)` every
input that decides the series' names and labels: equal keys, equal series. Neither is
believed on its own: when the collector builds a layout through
`_add_engine_series`, it compares these values with that function's (types included)
and uses them for that layout only if they are equal (`exporter.collector`).

Only for SGLang-shaped sources; a vLLM source (`kvledger.engines.vllm.views`) has no key and is
always built through `_add_engine_series`.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Mapping
from typing import Any

from accounting.figures import FIGURE_NAMES, HOLDER_NAMES
from accounting.gpu_parts import PART_NAMES
from accounting.snapfile.summary import Summary
from accounting.tp_status import TP_COUNTERS

GIB = 2**30
# An account's VMM series: each metric and the account field it reads.
VMM_ACCOUNT = {
    "kvledger_pages_mapped_total": "pages_mapped_total",
    "kvledger_pages_unmapped_total": "pages_unmapped_total",
    "kvledger_map_calls_total": "map_calls",
    "kvledger_map_seconds_total": "map_seconds_total",
    "kvledger_unmap_seconds_total": "unmap_seconds_total",
    "kvledger_allocator_failures_total": "driver_failures_total",
    "kvledger_handle_pages": "handle_pages",
    "kvledger_mapped_pages": "mapped_pages",
    "kvledger_peak_handle_pages": "peak_handle_pages",
}
# A family's eviction series, each `sglang:kv_cache_<field>` of the holder row's field.
EVICTED = (
    "evicted_slots_total",
    "evicted_bytes_total",
    "window_evicted_slots_total",
    "window_evicted_bytes_total",
)
# A holder row's values in the order they are added: each holder's (slots, bytes), then
# the eviction counters.
_HOLDER_ORDER = (*itertools.chain(*((f"slots_{h}", f"bytes_{h}") for h in HOLDER_NAMES)), *EVICTED)
_chain = itertools.chain.from_iterable
_tp_values = operator.attrgetter(*TP_COUNTERS)


def shape_key(s: Summary, eng: Mapping[str, str]) -> Hashable:
    """Everything that decides the names and labels of `s`'s engine series under the
    engine labels `eng`."""
    f, h, a = s.family_columns, s.holder_columns, s.account_columns
    engine = s.engine
    return (
        tuple(eng.items()),
        tuple(f["family"]),
        tuple(f["owner"]),
        tuple(h["family"]),
        tuple(h["owner"]),
        None if engine is None else len(engine.request_bytes_counts),
        s.tp is None,
        tuple(
            (
                r.source,
                r.available,
                r.device_bytes is not None,
                r.unattributed_bytes is not None,
                tuple(p for p in PART_NAMES if p in r.parts) if r.available and r.parts else (),
                r.total_bytes is not None,
            )
            for r in s.reconciliation
        ),
        tuple(a["family"]),
        tuple(a["pool"]),
        tuple(a["owner"]),
        tuple(map(len, a["map_bucket_counts"])),
    )


def _histogram(out: list[Any], counts: list[int], total: float) -> None:
    """Cumulative bucket counts, then the count (the last bucket) and the sum."""
    out += itertools.accumulate(counts)
    out.append(out[-1] if counts else 0)
    out.append(total)


def values(s: Summary) -> list[Any]:
    """The values of `s`'s engine series, in the order `_add_engine_series` adds them."""
    f, h, a = s.family_columns, s.holder_columns, s.account_columns
    out: list[Any] = [s.totals.physical_bytes / GIB]
    out += _chain(zip(*(f[name] for name in FIGURE_NAMES), strict=True))
    out += _chain(zip(*(h[name] for name in _HOLDER_ORDER), strict=True))
    engine = s.engine
    if engine is not None:
        out.append(engine.retracted_requests_total)
        _histogram(out, list(engine.request_bytes_counts), engine.request_bytes_sum)
    out.append(len(s.violations))
    if s.tp is not None:
        out += _tp_values(s.tp)
    for r in s.reconciliation:
        out.append(1 if r.available else 0)
        if r.available and r.device_bytes is not None:
            out.append(float(r.device_bytes))
            if r.unattributed_bytes is not None:
                out.append(float(r.unattributed_bytes))
        if r.available and r.parts:
            out += (r.parts[p] for p in PART_NAMES if p in r.parts)
        if r.available and r.total_bytes is not None:
            out.append(r.total_bytes)
    vmm = zip(*(a[field] for field in VMM_ACCOUNT.values()), strict=True)
    for owner, peak, counts, seconds, vmm_values in zip(
        a["owner"],
        a["peak_occupied_slots"],
        a["map_bucket_counts"],
        a["map_seconds_total"],
        vmm,
        strict=True,
    ):
        out.append(peak)
        if owner == "vmm":
            out += vmm_values
            _histogram(out, counts, seconds)
    return out


def same(these: list[Any], those: list[Any]) -> bool:
    """Equal values of equal types, one by one (1 and 1.0 are written differently)."""
    return these == those and list(map(type, these)) == list(map(type, those))
