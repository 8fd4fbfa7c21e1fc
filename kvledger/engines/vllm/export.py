"""vLLM's engine export (`exporter.engines`): the `kvledger_vllm_*` series and the /debug/kv
`vllm` section of a vLLM source, read from its views (`kvledger.engines.vllm.views`).

`EXPORT` is what `kvledger serve` registers with the exporter (`kvledger.engines.exports`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from prometheus_client.utils import floatToGoString
from pydantic import BaseModel, Field

from accounting.request_slots import REQUEST_SLOTS_BUCKETS
from exporter.engines import AddSample
from exporter.models import model_of
from exporter.sources import BufferMapError, SourceView
from kvledger.engines.vllm import metrics, views

# The series of a source, each the attribute of its view it is read from: a worker's storage
# and each group's bytes, an engine core's blocks and each group's slots.
_WORKER = ("physical_bytes", "blocks", "block_bytes", "committed_blocks")
_WORKER_NAMES = (
    "kv_cache_physical_bytes", "kv_cache_blocks", "kv_block_bytes", "kv_cache_committed_blocks"
)  # fmt: skip
_WORKER_GROUP = (
    "tensor_bytes", "reserved_bytes", "physical_bytes", "slot_bytes", "block_size", "layers"
)  # fmt: skip
_ENGINE = ("blocks", "occupied_blocks", "evictable_blocks", "free_blocks")
_ENGINE_GROUP = ("capacity_slots", "occupied_slots", "evictable_slots", "free_slots")
_SLOTS_LE = tuple(floatToGoString(b) for b in (*REQUEST_SLOTS_BUCKETS, float("inf")))


WorkerGroupModel: Any = model_of(
    views.WorkerGroup, name="VllmWorkerGroupModel", doc="One KV-cache group as a worker holds it."
)
EngineGroupModel: Any = model_of(
    views.EngineGroup,
    name="VllmEngineGroupModel",
    doc="One KV-cache group's slots in the engine core's block pool.",
    drop=("held_slots",),
    extra={"held_slots": dict[str, int]},
)
EngineRequestModel: Any = model_of(
    views.EngineRequest,
    name="VllmEngineRequestModel",
    doc="A running request's slots and blocks per group (the view's group order); shared "
    "prefix blocks counted in every request that holds them.",
)
WorkerModel: Any = model_of(
    views.WorkerView,
    name="VllmWorkerModel",
    doc="A vLLM worker's KV storage (counted once) and its groups (aliasing the storage).",
    drop=("groups",),
    extra={"groups": list[WorkerGroupModel]},
)
EngineModel: Any = model_of(
    views.EngineView,
    name="VllmEngineModel",
    doc="A vLLM engine core's block pool (shared by every group) and each group's slots.",
    drop=("groups", "held_blocks", "requests"),
    extra={
        "groups": list[EngineGroupModel],
        "held_blocks": dict[str, int],
        "requests": list[EngineRequestModel],
    },
)


class VllmModel(BaseModel):
    """A vLLM source's groups: a worker's bytes or an engine core's occupancy."""

    role: str = Field(description="vllm_worker (the bytes) or vllm_scheduler (the blocks)")
    labels: dict[str, str] = Field(description="vLLM's labels on its kvledger_vllm_* metrics")
    worker: WorkerModel | None = None
    engine: EngineModel | None = None
    error: str | None = Field(default=None, description="why the worker's groups are not shown")


class VllmExport:
    """vLLM's workers (bytes) and engine cores (blocks), told apart by `engine_type`."""

    name = "vllm"
    metrics = metrics.METRICS
    debug_model = VllmModel
    debug_description = "present for a vLLM source (docs/vllm.md)"
    # `kv_pool` counts blocks (and `kv_pool_evictable`, on an engine core), each group its
    # tokens or states, all of them aliasing the pool's blocks: their sum is no quantity.
    slots_add_up = False

    def claims(self, labels: Mapping[str, str]) -> bool:
        return views.role(labels) is not None

    def add_series(self, add: AddSample, view: SourceView) -> None:
        """A worker's bytes or an engine core's blocks, under vLLM's labels; none of
        SGLang's names."""
        names: tuple[str, ...]
        fields: tuple[str, ...]
        group_fields: tuple[str, ...]
        summary = view.summary
        found: Any
        if views.role(summary.labels) == views.WORKER:
            found = views.worker_of(view.published)
            labels = views.worker_labels(summary.labels)
            names, fields, group_fields = _WORKER_NAMES, _WORKER, _WORKER_GROUP
        else:
            found = views.engine_view(summary)
            labels = views.engine_labels(summary.labels)
            names, fields, group_fields = _ENGINE, _ENGINE, _ENGINE_GROUP
        for name, field in zip(names, fields, strict=True):
            add(metrics.PREFIX + name, labels, getattr(found, field))
        for holder, blocks in getattr(found, "held_blocks", ()):
            add(metrics.PREFIX + "held_blocks", {**labels, "holder": holder}, blocks)
        for g in found.groups:
            gl = {**labels, "group": str(g.group), "kind": g.kind}
            for field in group_fields:
                add(metrics.PREFIX + "group_" + field, gl, getattr(g, field))
        if isinstance(found, views.EngineView):
            _add_footprints(add, labels, found)

    def debug(self, view: SourceView) -> VllmModel:
        summary = view.summary
        role = views.role(summary.labels)
        assert role is not None, "debug() of a source this export does not claim"
        if role == views.SCHEDULER:
            e = views.engine_view(summary)
            return VllmModel(
                role=role,
                labels=views.engine_labels(summary.labels),
                engine=EngineModel(**_as_dict(e)),
            )
        labels = views.worker_labels(summary.labels)
        try:
            w = views.worker_of(view.published)
        except BufferMapError as err:
            return VllmModel(role=role, labels=labels, error=str(err))
        return VllmModel(role=role, labels=labels, worker=WorkerModel(**_as_dict(w)))


def _add_footprints(add: AddSample, labels: dict[str, str], e: views.EngineView) -> None:
    """Per group: its slots by holder, and (where the engine core published footprints)
    the running requests' slots as a histogram; the running requests."""
    name = metrics.PREFIX + "request_slots"
    for g in e.groups:
        gl = {**labels, "group": str(g.group), "kind": g.kind}
        for holder, slots in g.held_slots:
            add(metrics.PREFIX + "group_held_slots", {**gl, "holder": holder}, slots)
        if g.request_slots_sum is None:
            continue
        cumulative = 0
        for le, n in zip(_SLOTS_LE, g.request_slots_counts, strict=True):
            cumulative += n
            add(name, {**gl, "le": le}, cumulative, sample=name + "_bucket")
        add(name, gl, cumulative, sample=name + "_count")
        add(name, gl, g.request_slots_sum, sample=name + "_sum")
    if e.running_requests is not None:
        add(metrics.PREFIX + "running_requests", labels, e.running_requests)


def _as_dict(found: Any) -> dict[str, Any]:
    groups = []
    for g in found.groups:
        d = dataclasses.asdict(g)
        if "held_slots" in d:
            d["held_slots"] = dict(g.held_slots)  # holder -> slots
        groups.append(d)
    out = {**dataclasses.asdict(found), "groups": groups}
    if "held_blocks" in out:
        out["held_blocks"] = dict(found.held_blocks)  # holder -> blocks
    return out


EXPORT = VllmExport()
