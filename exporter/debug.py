"""`GET /debug/kv`: the document built from snapshots (its schema: `exporter.debug_schema`).

The same `Scan` a scrape reads becomes one JSON document: per source its buffer
map, per-family figures, accounts, relation results, reconciliation, epoch and
age; per rank its totals; the snapshot files not served, with why.

Filters: `rank` keeps the sources whose `tp_rank` is that rank; `family` keeps
that family's rows in `families`, `accounts`, `buffers` and `violations`;
`layer` keeps that layer's rows in `buffers` (and their violations). A filter
value no source has is a `FilterError` naming the parameter and what exists.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from accounting.figures import (
    FIGURES,
    Figures,
)
from accounting.gpu_parts import PARTS
from accounting.rows import BufferRow
from accounting.snapfile.summary import Reconciliation
from exporter import engines
from exporter.collector import GIB
from exporter.debug_schema import (
    AccountModel,
    BufferModel,
    DebugKv,
    EngineModel,
    FamilyModel,
    FigureDef,
    FiguresModel,
    FileProblemModel,
    Filters,
    GpuModel,
    GpuPartModel,
    HeldModel,
    HoldersModel,
    LastErrorModel,
    RankModel,
    ReconciliationModel,
    SourceBase,
    TotalsModel,
    TpModel,
    ViolationModel,
    models,
)
from exporter.metrics import engine_labels
from exporter.sources import Scan, SourceView


class FilterError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


def _known(values: set[Any]) -> str:
    return ", ".join(repr(v) for v in sorted(values, key=str)) or "none (no source has published)"


def build(
    scan: Scan,
    *,
    family: str | None = None,
    rank: int | None = None,
    layer: int | None = None,
) -> DebugKv:
    views: Sequence[SourceView] = scan.views
    if rank is not None:
        ranks = {engine_labels(v.labels)["tp_rank"] for v in views}
        if str(rank) not in ranks:
            raise FilterError(
                "rank", f"rank={rank}: no source has tp_rank {rank}; known: {_known(ranks)}"
            )
        views = [v for v in views if engine_labels(v.labels)["tp_rank"] == str(rank)]
    if family is not None:
        families = {f.family for v in views for f in v.summary.families}
        if family not in families:
            raise FilterError(
                "family", f"family={family!r} is unknown; expected one of {_known(families)}"
            )
    if layer is not None:
        layers = {b.spec.layer for v in views for b in _buffers(v)[0]} - {None}
        if layer not in layers:
            raise FilterError(
                "layer", f"layer={layer} has no buffer; known layers: {_known(layers)}"
            )
    source_model, document = models()
    return document(
        generated_at=time.time(),
        filters=Filters(family=family, rank=rank, layer=layer),
        figures=[
            FigureDef(name=f.name, unit=f.unit, meaning=f.meaning, relation=f.relation)
            for f in FIGURES
        ],
        ranks=[
            RankModel(
                source=v.source,
                up=v.up,
                engine_labels=engine_labels(v.labels),
                memory_usage_gb=v.summary.totals.physical_bytes / GIB,
                totals=_totals(v),
            )
            for v in views
        ],
        sources=[_source(source_model, v, family=family, layer=layer) for v in views],
        files_not_served=[
            FileProblemModel(name=p.name, reason=p.reason, detail=p.detail)
            for p in scan.files.problems
        ],
    )


def _figures(f: Figures) -> Any:
    return FiguresModel(**f.to_dict())


def _totals(v: SourceView) -> Any:
    """The source's figures summed over its families; the slot figures null where its
    engine export says its families' slots are of kinds that do not add (vLLM's)."""
    values: dict[str, int | None] = dict(v.summary.totals.to_dict())
    export = engines.claiming(v.summary.labels)
    if export is not None and not export.slots_add_up:
        values.update({f.name: None for f in FIGURES if f.per_account})
    return TotalsModel(**values)


def _buffers(v: SourceView) -> tuple[Sequence[BufferRow], str | None]:
    """A source's buffer rows (parsed and checked on first use), or () and why not."""
    snap, error = v.published.buffer_map()
    return (snap.buffers if snap is not None else ()), error


def _gpu(reconciliation: Sequence[Reconciliation]) -> GpuModel | None:
    r = next((r for r in reconciliation if r.uuid or r.source == "nvml"), None)
    if r is None:
        return None
    detail = r.detail

    def _int(key: str) -> int | None:
        value = detail.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return GpuModel(
        uuid=r.uuid,
        gpu=r.gpu,
        readable=r.available,
        reason=r.reason,
        basis=r.basis,
        basis_note=str(detail.get("process_figure") or ""),
        device_used_bytes=_int("used_bytes"),
        process_used_bytes=_int("process_used_bytes"),
        total_bytes=r.total_bytes,
        parts=[
            GpuPartModel(part=p.name, scope=p.scope, bytes=r.parts[p.name], meaning=p.meaning)
            for p in PARTS
            if p.name in r.parts
        ],
    )


def _source(model: Any, v: SourceView, *, family: str | None, layer: int | None) -> SourceBase:
    """Figures, accounts and violations from the summary the metrics are built from;
    the buffer rows from the buffer map."""
    d, p = v.summary, v.published
    rows, buffers_error = _buffers(v)
    buffers = [
        b
        for b in rows
        if (family is None or b.spec.family == family) and (layer is None or b.spec.layer == layer)
    ]
    accounts = [a for a in d.accounts if family is None or a.family == family]
    if family is None and layer is None:
        violations = list(d.violations)
    else:
        subjects = {f"{b.spec.pool}/{b.spec.name}" for b in buffers}
        if layer is None:
            subjects |= {a.key for a in accounts}
        violations = [x for x in d.violations if x.subject in subjects]
    return model(
        source=v.source,
        up=v.up,
        stale_reason=v.stale_reason,
        pid=p.pid,
        host=p.host,
        labels=dict(d.labels),
        engine_labels=engine_labels(d.labels),
        epoch=d.epoch,
        sequence=p.sequence,
        taken_at=d.taken_at,
        published_at=p.published_at,
        age_seconds=v.age_seconds,
        heartbeat_age_seconds=v.heartbeat_age_seconds,
        interval_seconds=p.interval,
        memory_usage_gb=d.totals.physical_bytes / GIB,
        totals=_totals(v),
        families=[
            FamilyModel(family=f.family, owner=f.owner.value, figures=_figures(f.figures))
            for f in d.families
            if family is None or f.family == family
        ],
        accounts=[AccountModel(**a.to_dict()) for a in accounts],
        buffers=[BufferModel(**b.to_dict()) for b in buffers],
        violations=[ViolationModel(**x.to_dict()) for x in violations],
        buffers_error=buffers_error,
        reconciliation=[ReconciliationModel(**r.to_dict()) for r in d.reconciliation],
        gpu=_gpu(d.reconciliation),
        tp=TpModel(**d.tp.to_dict()) if d.tp is not None else None,
        publish_errors=dict(p.publish_errors),
        last_error=LastErrorModel(**v.last_error.to_dict()) if v.last_error else None,
        holders=_holders(d, family),
        engine=EngineModel(**d.engine.to_dict()) if d.engine is not None else None,
        **_engine_sections(v),
    )


def _holders(d: Any, family: str | None) -> list[HoldersModel]:
    capacity = {(f.family, f.owner): f.figures for f in d.families}
    out = []
    for h in d.holders:
        if family is not None and h.family != family:
            continue
        figs = capacity.get((h.family, h.owner))
        cap = figs.capacity_slots if figs is not None else 0
        occ = h.slots.total()
        out.append(
            HoldersModel(
                family=h.family,
                owner=h.owner.value,
                slots=HeldModel(**h.slots.to_dict()),
                bytes=HeldModel(**h.bytes.to_dict()),
                free_slots=max(cap - occ, 0),
                occupied_fraction=occ / cap if cap else 0.0,
                evicted_slots_total=h.evicted_slots_total,
                evicted_bytes_total=h.evicted_bytes_total,
                window_evicted_slots_total=h.window_evicted_slots_total,
                window_evicted_bytes_total=h.window_evicted_bytes_total,
            )
        )
    return out


def _engine_sections(v: SourceView) -> dict[str, Any]:
    export = engines.claiming(v.summary.labels)
    return {} if export is None else {export.name: export.debug(v)}
