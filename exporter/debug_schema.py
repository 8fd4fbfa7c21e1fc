"""The schema of `GET /debug/kv`: pydantic models (hence OpenAPI) of the document
`exporter.debug` builds.

Figure fields are generated from `accounting.figures.FIGURES`, with each figure's meaning as
its description; the models of the snapshot's rows (buffers, accounts, violations,
reconciliation, TP status, the figures table) are generated from accounting's dataclasses by
`exporter.models`, so their fields are declared once. A source's model carries a section per
registered engine export (`exporter.engines`), so `models()` builds the served ones.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, Field, create_model

from accounting.buffers import BufferSpec, Owner
from accounting.engine_state import MAX_REQUESTS, RequestHeld
from accounting.figures import (
    FIGURES,
    HOLDER_PRECEDENCE,
    HOLDER_RELATION,
    HOLDERS,
    Figure,
)
from accounting.relations import Violation
from accounting.rows import AccountRow, BufferRow
from accounting.snapfile.format import DIRECTORY_REASONS, PUBLISH_ERROR_REASONS
from accounting.snapfile.summary import Reconciliation
from accounting.tp_status import TpStatus
from exporter import engines
from exporter.models import json_type, model_of

_FIGURE_FIELDS: dict[str, Any] = {
    f.name: (int, Field(description=f"{f.meaning} (unit: {f.unit}). Relation: {f.relation}."))
    for f in FIGURES
}
# One int field per figure, described by the figures table.
FiguresModel: Any = create_model(
    "Figures",
    __doc__="The ledger's figures, each kept separately and never summed into another.",
    **_FIGURE_FIELDS,
)

# A source's totals: the bytes figures add up over families; the slot figures are the sum
# over families only where the source's families count slots of one kind, else null.
_TOTAL_FIELDS: dict[str, Any] = {
    f.name: (
        (int, Field(description=f"{f.meaning} (unit: {f.unit}), summed over families."))
        if not f.per_account
        else (
            int | None,
            Field(
                description=f"{f.meaning} (unit: {f.unit}), summed over families; null for a "
                "source whose families count slots of different kinds that do not add (a vLLM "
                "source: blocks in kv_pool, tokens or states in each group): read them family "
                "by family."
            ),
        )
    )
    for f in FIGURES
}
TotalsModel: Any = create_model(
    "Totals",
    __doc__="A source's figures summed over its families (slot figures: see each field).",
    **_TOTAL_FIELDS,
)

# The rows of a snapshot: fields from accounting's dataclasses (exporter.models), described here.
FigureDef: Any = model_of(
    Figure,
    name="FigureDef",
    doc="One figure of the figures table (accounting.figures).",
    descriptions={"unit": '"bytes" or "slots"'},
)
BufferModel: Any = model_of(
    BufferRow,
    name="BufferModel",
    doc="One tensor handed to the model (e.g. one layer's SWA KV buffer) and its figures.",
    include=(BufferSpec,),
    drop=("spec",),
    extra={"occupied_bytes": int},
    descriptions={
        "owner": '"vmm" (VMM allocator, page by page) or "runtime" (whole tensor)',
        "account": "the index space (pool/family) whose slots it holds",
    },
)
AccountModel: Any = model_of(
    AccountRow,
    name="AccountModel",
    doc="One index space (the layer buffers sharing its slots) and its allocator activity.",
    descriptions={
        "map_bucket_counts": "page ids mapped per seconds-per-page-id bucket (each page id of a "
        "map operation observes its time / its page ids; accounting.ledger.MAP_SECONDS_BUCKETS, "
        "then one past the last bound); not cumulative"
    },
)
ViolationModel: Any = model_of(
    Violation,
    name="ViolationModel",
    doc="A relation between figures that a snapshot broke, with the values that broke it.",
    descriptions={"subject": "pool/buffer or account key"},
)
TpModel: Any = model_of(
    TpStatus,
    name="TpModel",
    doc="This rank's control traffic with the other TP ranks (accounting.tp_status).",
    descriptions={
        "exchanges_total": "collectives this rank took part in",
        "page_ops_total": "page ids mapped or unmapped as rank 0 decided",
        "divergences_total": "exchanges at which a rank's view differed from rank 0's",
        "peer_failures_total": "exchanges that failed: a rank died or timed out",
        "last_error": "the last divergence or peer failure, both views included",
    },
)


ReconciliationModel: Any = model_of(
    Reconciliation,
    name="ReconciliationModel",
    doc="The ledger held against device truth (accounting.reconcile).",
    descriptions={
        "source": "which truth: host_memfd, nvml, ...",
        "basis": "which figure of that truth was read (memfd, process, device), or empty",
        "available": "False when the truth could not be read",
        "reason": "why the truth is unavailable, or empty",
        "device_bytes": "what the truth says is held",
        "ledger_bytes": "the ledger figure it is held against",
        "unattributed_bytes": "device_bytes - ledger_bytes",
        "parts": "the GPU's used memory split into parts (accounting.gpu_parts), or {}",
        "uuid": "the GPU's NVML UUID (dcgm-exporter's UUID label), or empty",
        "gpu": "the GPU's NVML index (dcgm-exporter's gpu label), or empty",
        "total_bytes": "the device's memory size (NVML total), or null",
    },
)


class GpuPartModel(BaseModel):
    part: str
    scope: str = Field(description="process (this process's memory) or device (the rest)")
    bytes: int
    meaning: str


class GpuModel(BaseModel):
    """Where this source's GPU went (accounting.gpu_parts), from its NVML truth."""

    uuid: str = Field(description="NVML's UUID of the GPU (dcgm-exporter's UUID label)")
    gpu: str = Field(description="NVML's index of the GPU (dcgm-exporter's gpu label)")
    readable: bool = Field(description="False when NVML could not be read (reason says why)")
    reason: str
    basis: str = Field(
        description="process: the process's parts add up to NVML's per-process figure; "
        "device: NVML does not list this process, device-wide figures are used"
    )
    basis_note: str = Field(description="why NVML's per-process figure is not read, or 'read'")
    device_used_bytes: int | None = Field(description="NVML device-wide used (the parts' sum)")
    process_used_bytes: int | None = Field(description="NVML's figure for this process")
    total_bytes: int | None = Field(description="the device's memory size")
    parts: list[GpuPartModel]


class FamilyModel(BaseModel):
    family: str
    owner: json_type(Owner)  # type: ignore[valid-type]
    figures: FiguresModel


class LastErrorModel(BaseModel):
    reason: str = Field(
        description="one of " + ", ".join(PUBLISH_ERROR_REASONS) + " (the current cause only)"
    )
    detail: str
    at: float = Field(description="Unix time")


_HELD_DOC = (
    "Occupied slots or bytes by holder (accounting.figures.Held). "
    + HOLDER_PRECEDENCE[0].upper()
    + HOLDER_PRECEDENCE[1:]
    + "."
)
_HELD_FIELDS: dict[str, Any] = {h.name: (int, Field(description=h.meaning)) for h in HOLDERS}
HeldModel: Any = create_model("Held", __doc__=_HELD_DOC, **_HELD_FIELDS)


class HoldersModel(BaseModel):
    """Who holds one family's occupied slots and bytes, and what the engine evicted."""

    family: str
    owner: json_type(Owner)  # type: ignore[valid-type]
    slots: HeldModel
    bytes: HeldModel
    free_slots: int = Field(description="capacity_slots - occupied_slots")
    occupied_fraction: float = Field(description="occupied_slots / capacity_slots (0 if none)")
    evicted_slots_total: int = Field(description="slots the prefix tree evicted")
    evicted_bytes_total: int
    window_evicted_slots_total: int = Field(description="slots freed by sliding-window eviction")
    window_evicted_bytes_total: int


RequestModel: Any = model_of(
    RequestHeld,
    name="RequestModel",
    doc="One running request's KV footprint (the largest are listed).",
    descriptions={
        "rid": "the engine's request id",
        "tokens": "tokens it holds KV for",
        "age_seconds": "since the engine received it",
        "bytes": "KV bytes over all families",
        "bytes_by_family": "KV bytes per family (slots it holds x slot_bytes)",
    },
)


class EngineModel(BaseModel):
    """What the engine's holder reader said (accounting.engine_state)."""

    holders_from: str = Field(description="what the holders were read from; empty if nothing")
    notes: list[str] = Field(description="what could not be read, one line each")
    retracted_requests_total: int
    running_requests: int
    request_bytes_sum: int = Field(description="KV bytes of all running requests")
    request_bytes_counts: list[int] = Field(
        description="running requests per KV-bytes bucket (accounting.engine_state."
        "REQUEST_BYTES_BUCKETS, then one past the last bound); not cumulative"
    )
    requests: list[RequestModel] = Field(
        description=f"the running requests holding the most KV bytes, largest first (at most "
        f"{MAX_REQUESTS})"
    )


class SourceBase(BaseModel):
    """A source's section of /debug/kv, less the sections of engine exports (`models`)."""

    source: str
    up: bool
    stale_reason: str | None
    pid: int | None
    host: str | None
    labels: dict[str, str] = Field(description="the ledger's labels as published")
    engine_labels: dict[str, str] = Field(description="SGLang's labels on its metrics")
    epoch: int = Field(
        description="changes the ledger had applied when the snapshot was taken (page events, "
        "slot-figure reports)"
    )
    sequence: int
    taken_at: float = Field(description="Unix time the snapshot was taken")
    published_at: float = Field(description="Unix time of the publisher's heartbeat")
    age_seconds: float
    heartbeat_age_seconds: float
    interval_seconds: float
    memory_usage_gb: float = Field(description="physical bytes of all families / 2^30")
    totals: TotalsModel
    families: list[FamilyModel]
    accounts: list[AccountModel]
    buffers: list[BufferModel]
    violations: list[ViolationModel]
    buffers_error: str | None = Field(
        None,
        description="why this source's buffer rows are not shown (they failed their checks "
        "when read for this page; its figures above and its metrics are unaffected; counted "
        'in kvledger_snapshot_file_errors_total{reason="buffers"})',
    )
    reconciliation: list[ReconciliationModel]
    gpu: GpuModel | None = Field(
        None, description="where the GPU went, for a source whose truth is NVML"
    )
    tp: TpModel | None = Field(None, description="present for a pool under tensor parallelism")
    publish_errors: dict[str, int] = Field(
        default_factory=dict,
        description="failed publishes per reason ("
        + ", ".join(PUBLISH_ERROR_REASONS)
        + "), as the publisher counted them in its latest file",
    )
    last_error: LastErrorModel | None = Field(
        None,
        description="a down source's current cause: while no publisher can write in the "
        "snapshot directory, what the exporter sees there ("
        + ", ".join(DIRECTORY_REASONS)
        + "), else its publisher's last error from its latest file (unless one of those "
        "causes that no longer holds)",
    )
    holders: list[HoldersModel] = Field(
        default_factory=list, description="who holds each family's occupied slots and bytes"
    )
    engine: EngineModel | None = Field(
        None, description="the engine's holder reader: source, notes, per-request footprints"
    )


class RankModel(BaseModel):
    """Per-rank totals (one source is one engine process, i.e. one rank). The bytes figures
    add up over families. The slot figures of `totals` are null for a source whose engine
    export says its families' slots do not add (a vLLM source: `kv_pool` counts blocks, each
    group tokens or states, and the groups alias the pool's blocks); an SGLang source's are
    its families' sum, which adds index spaces of different kinds (tokens, compressed rows,
    state rows) when it has several and is then not a quantity either: compare slots family
    by family (the source's `families`), as the page does."""

    source: str
    up: bool
    engine_labels: dict[str, str]
    memory_usage_gb: float
    totals: TotalsModel


class Filters(BaseModel):
    family: str | None = None
    rank: int | None = None
    layer: int | None = None


class FileProblemModel(BaseModel):
    """A snapshot file not served (or the directory itself, with an empty name)."""

    name: str = Field(description="file name in the snapshot directory; empty for the directory")
    reason: str = Field(
        description="symlink, not_regular, owner, too_large, open, parse, "
        "nesting, schema, too_many_files; for the directory itself (empty name): directory "
        "(missing, unreadable or refused by the rules), or why no publisher can write there "
        "now: " + ", ".join(DIRECTORY_REASONS)
    )
    detail: str


class HolderDef(BaseModel):
    name: str
    meaning: str


class HoldersTable(BaseModel):
    """The holders of occupied slots, their precedence and the relation the ledger checks."""

    holders: list[HolderDef] = Field(
        default_factory=lambda: [HolderDef(name=h.name, meaning=h.meaning) for h in HOLDERS]
    )
    precedence: str = HOLDER_PRECEDENCE
    relation: str = HOLDER_RELATION


class DebugKv(BaseModel):
    """The document's schema as typing sees it; `models()` gives the one served, whose
    sources carry the sections of the registered engine exports."""

    generated_at: float
    filters: Filters
    figures: list[FigureDef] = Field(description="the figures table: what each figure counts")
    holders: HoldersTable = Field(
        default_factory=lambda: HoldersTable(),
        description="the holders table: who can hold an occupied slot (accounting.figures)",
    )
    ranks: list[RankModel]
    sources: list[SourceBase]
    files_not_served: list[FileProblemModel] = Field(
        default_factory=list,
        description="snapshot files refused, each with why (at most 100 listed; all are "
        "counted in kvledger_snapshot_file_errors_total)",
    )


@functools.cache
def _models(exports: tuple[Any, ...]) -> tuple[Any, Any]:
    sections: dict[str, Any] = {
        e.name: (e.debug_model | None, Field(None, description=e.debug_description))
        for e in exports
    }
    source: Any = create_model(
        "SourceModel", __base__=SourceBase, __doc__=SourceBase.__doc__, **sections
    )
    document = create_model(
        "DebugKv", __base__=DebugKv, __doc__="/debug/kv", sources=(list[source], ...)
    )
    return source, document


def models() -> tuple[Any, Any]:
    """The models of a source and of the document, with a section per registered engine
    export (`exporter.engines`: vLLM's `vllm`), each None for a source it does not claim."""
    return _models(engines.registered())
