"""Every metric kvledger exports, declared once: name, type, help, labels.

The collector, the tests and the dashboards read this table; nothing else names a
metric. The per-family gauges are generated from `accounting.figures.FIGURES`,
one `sglang:kv_cache_<figure>` per figure. Names are the names a Prometheus
server stores (a counter's name carries its `_total`); every one is a valid
legacy (pre-UTF-8) metric name, so no escaping scheme rewrites it.

Every metric except those marked `engine=False` also carries the source's engine
labels, SGLang's: `ENGINE_LABELS`, plus `dp_rank` where the engine sets it (`engine_labels`),
and, for a source whose device truth is a GPU (NVML), that GPU's `UUID` and `gpu` (NVML's
index): dcgm-exporter's two labels, so a query joins kvledger's series with the fleet's
(`DEVICE_LABELS`, docs/metrics.md#joining-dcgm-exporter).
No label ever takes the value "total": totals are separate metrics or sums in PromQL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from accounting.engine_state import MAX_REQUESTS, REQUEST_BYTES_BUCKETS
from accounting.figures import FIGURES, HOLDER_NAMES, HOLDER_PRECEDENCE
from accounting.gpu_parts import PARTS
from accounting.ledger import MAP_SECONDS_BUCKETS
from accounting.snapfile.format import DIRECTORY_REASONS, PUBLISH_ERROR_REASONS

ENGINE_LABELS: tuple[str, ...] = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
OPTIONAL_ENGINE_LABELS: tuple[str, ...] = ("dp_rank",)
# dcgm-exporter's names for the GPU a series is about: the NVML UUID and NVML index. Carried by
# every engine series of a source whose truth reader names its GPU (`device_labels`).
DEVICE_LABELS: tuple[str, ...] = ("UUID", "gpu")
# Values used when a source's ledger does not set an engine label.
ENGINE_LABEL_DEFAULTS: dict[str, str] = {
    "model_name": "unknown",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}
# Why a source is left out of a scrape (kvledger_source_errors_total's `reason`): an
# in-process ledger's snapshot failed, or building a source's series failed.
SOURCE_ERROR_REASONS: tuple[str, ...] = ("snapshot", "render")
TYPES = ("gauge", "counter", "histogram")
_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def engine_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The engine labels a source's metrics carry: SGLang's, from the source's ledger labels,
    defaults filled in, `dp_rank` only where set."""
    out = {k: str(labels.get(k) or ENGINE_LABEL_DEFAULTS[k]) for k in ENGINE_LABELS}
    for k in OPTIONAL_ENGINE_LABELS:
        if labels.get(k) not in (None, ""):
            out[k] = str(labels[k])
    return out


def device_labels(reconciliation: Iterable[Any]) -> dict[str, str]:
    """`UUID` and `gpu` of the GPU a source's truth names (the first reconciliation entry
    with a UUID: `accounting.snapfile.summary.Reconciliation`), {} for a source on no GPU."""
    for r in reconciliation:
        if r.uuid:
            out = {"UUID": r.uuid}
            if r.gpu:
                out["gpu"] = r.gpu
            return out
    return {}


EngineKey = tuple[tuple[str, str], ...]


def engine_key(labels: Mapping[str, str]) -> EngineKey:
    """`engine_labels` as a key: two live sources with the same key would export the same
    series."""
    return tuple(sorted(engine_labels(labels).items()))


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as stored by Prometheus; a counter's ends in _total, a histogram's is the base name
    type: str  # "gauge", "counter" or "histogram"
    help: str
    labels: tuple[str, ...]  # labels of its own, after the engine labels
    engine: bool = True  # carries the source's engine labels
    figure: str | None = None  # the accounting figure it exports, for per-family gauges

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"metric {self.name!r}: type={self.type!r}, expected one of {TYPES}")
        if not _LEGACY_NAME.match(self.name):
            raise ValueError(f"metric name {self.name!r} is not a legacy Prometheus name")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: a counter's name, and only it, ends in _total")
        for label in self.labels:
            if not _LEGACY_LABEL.match(label) or label.startswith("__"):
                raise ValueError(f"metric {self.name!r}: label {label!r} is not a valid label name")

    @property
    def family_name(self) -> str:
        """The name prometheus-client's data model uses (a counter's without `_total`)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name

    @property
    def sample_names(self) -> tuple[str, ...]:
        """Series names this metric produces in Prometheus."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)


HEADLINE = "sglang:kv_cache_memory_usage_gb"
BUILD_INFO = "kvledger_build_info"
FIGURE_PREFIX = "sglang:kv_cache_"


def figure_metric(figure_name: str) -> str:
    return FIGURE_PREFIX + figure_name


def _figure_specs() -> list[MetricSpec]:
    out = []
    for f in FIGURES:
        summed = (
            "one value per index space, summed over the family's accounts"
            if f.per_account
            else "summed over the family's buffers (all layers)"
        )
        out.append(
            MetricSpec(
                figure_metric(f.name),
                "gauge",
                f"{f.name} ({f.unit}) per buffer family: {f.meaning}; {summed}. "
                f"Relation: {f.relation}.",
                ("family", "owner"),
                figure=f.name,
            )
        )
    return out


_ACCOUNT = ("family", "pool")
HELD_SLOTS = FIGURE_PREFIX + "held_slots"
HELD_BYTES = FIGURE_PREFIX + "held_bytes"
_HOLDERS = ", ".join(HOLDER_NAMES)


def _held_specs() -> list[MetricSpec]:
    what = (
        f"split by holder ({_HOLDERS}; accounting.figures.Held): {HOLDER_PRECEDENCE}. Where the "
        "holder could not be read (no tree reader for the engine), the slots are "
        "`unattributed` and /debug/kv says why."
    )
    return [
        MetricSpec(
            HELD_SLOTS,
            "gauge",
            "occupied_slots per buffer family " + what,
            ("family", "owner", "holder"),
        ),
        MetricSpec(
            HELD_BYTES,
            "gauge",
            "occupied_bytes per buffer family (held slots x slot_bytes, all layers) " + what,
            ("family", "owner", "holder"),
        ),
        MetricSpec(
            FIGURE_PREFIX + "evicted_slots_total",
            "counter",
            "Slots of the family the engine's prefix tree evicted (cached prefixes dropped to "
            "make room), converted from the tree's tokens to the family's slots.",
            ("family", "owner"),
        ),
        MetricSpec(
            FIGURE_PREFIX + "evicted_bytes_total",
            "counter",
            "Bytes of the family the prefix tree evicted (evicted slots x slot_bytes).",
            ("family", "owner"),
        ),
        MetricSpec(
            FIGURE_PREFIX + "window_evicted_slots_total",
            "counter",
            "Slots of the family freed because they left a running request's sliding "
            "window (SWA window eviction; not a prefix eviction, nothing reusable is lost).",
            ("family", "owner"),
        ),
        MetricSpec(
            FIGURE_PREFIX + "window_evicted_bytes_total",
            "counter",
            "Bytes of the family freed by sliding-window eviction.",
            ("family", "owner"),
        ),
        MetricSpec(
            FIGURE_PREFIX + "retracted_requests_total",
            "counter",
            "Running requests the engine retracted (sent back to its queue, their KV freed) "
            "because the KV cache had no room for their next tokens.",
            (),
        ),
        MetricSpec(
            FIGURE_PREFIX + "request_bytes",
            "histogram",
            "KV bytes each running request holds now, all families together (its tokens' "
            "slots in every family it uses, state rows included), as a distribution over "
            "the running requests: buckets "
            + ", ".join(f"{b >> 20} MiB" for b in REQUEST_BYTES_BUCKETS)
            + ". A gauge histogram: the +Inf bucket (and _count) is the running requests "
            "now, _sum their KV bytes; both go down as requests finish (no rate()). No "
            f"request ids: /debug/kv lists the {MAX_REQUESTS} largest requests by id.",
            (),
        ),
    ]


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        HEADLINE,
        "gauge",
        "Device memory the KV cache holds: physical bytes of all buffer families (every live "
        "VMM handle, mapped or spare, plus the storage of ordinary tensors), in GiB "
        "(bytes / 2^30, SGLang's unit). Live, from the latest ledger snapshot.",
        (),
    ),
    *_figure_specs(),
    *_held_specs(),
    MetricSpec(
        "kvledger_up",
        "gauge",
        "1 while the source's publisher is alive and its heartbeat fresh; 0 once it stopped "
        "without closing (its pid is gone or its heartbeat is too old) or while another live "
        "source carries the same engine labels (a conflict), and then its figures are not "
        "exported.",
        ("source",),
    ),
    MetricSpec(
        "kvledger_snapshot_age_seconds",
        "gauge",
        "Seconds since the source's latest snapshot was taken; grows without bound once the "
        "source is stale.",
        ("source",),
    ),
    MetricSpec(
        "kvledger_snapshot_epoch",
        "gauge",
        "Changes the source's ledger had applied when its latest snapshot was taken: page "
        "events and slot-figure reports (restarts at 0 with the process).",
        ("source",),
    ),
    MetricSpec(
        "kvledger_publish_interval_seconds",
        "gauge",
        "Seconds between the source's snapshots (0 for a ledger read in-process at scrape time).",
        ("source",),
    ),
    MetricSpec(
        "kvledger_publish_errors_total",
        "counter",
        "Publishes of the source that failed, per reason ("
        + ", ".join(PUBLISH_ERROR_REASONS)
        + "; no_inodes: no inode left with blocks free, read_only: EROFS), as its publisher "
        "counted them in its latest file: a publisher failing now and then, or one that "
        "recovered, shows here; while it cannot write at all see kvledger_source_last_error.",
        ("source", "reason"),
    ),
    MetricSpec(
        "kvledger_source_last_error",
        "gauge",
        "1, with the reason ("
        + ", ".join(PUBLISH_ERROR_REASONS)
        + "), for a source that is down and whose current cause is known: while no "
        "publisher can write in the snapshot directory, the cause the exporter sees there ("
        + ", ".join(DIRECTORY_REASONS)
        + "; a publisher that cannot write cannot say so), else the last error in its "
        "publisher's latest file, unless that is one of those causes and it no longer holds. "
        "A reason shows only while it holds. /debug/kv has the detail.",
        ("source", "reason"),
    ),
    MetricSpec(
        "kvledger_truth_available",
        "gauge",
        "1 when the device truth (host memfd, NVML) could be read for the latest snapshot, 0 "
        "when not (the debug endpoint's reconciliation says why); truth and unattributed bytes "
        "are exported only when it is 1.",
        ("truth",),
    ),
    MetricSpec(
        "kvledger_truth_bytes",
        "gauge",
        "Bytes the device truth reports for what the ledger accounts (e.g. the host backend's "
        "memfd blocks, or NVML's used-memory delta), per truth source.",
        ("truth",),
    ),
    MetricSpec(
        "kvledger_unattributed_bytes",
        "gauge",
        "Device truth minus the ledger's physical bytes for the same scope: memory the device "
        "holds that no buffer of the ledger accounts for (negative: the ledger counts more "
        "than the device shows).",
        ("truth",),
    ),
    MetricSpec(
        "kvledger_gpu_memory_bytes",
        "gauge",
        "Where the GPU's used memory went, per part (accounting.gpu_parts): "
        + "; ".join(f"{p.name}: {p.meaning}" for p in PARTS)
        + ". The parts add up to NVML's device-wide used memory, and this process's parts "
        "plus unattributed to NVML's per-process figure, at every publish (broken: "
        "kvledger_relation_violations). Exported where the truth is NVML and readable.",
        ("part",),
    ),
    MetricSpec(
        "kvledger_gpu_memory_total_bytes",
        "gauge",
        "The GPU's memory size as NVML reports it (total), next to which the parts of "
        "kvledger_gpu_memory_bytes stack up to the device's used memory.",
        (),
    ),
    MetricSpec(
        "kvledger_relation_violations",
        "gauge",
        "Relations between figures (occupied <= mapped <= physical, mapped <= reserved, whole "
        "pages, nothing negative, ...) broken in the latest snapshot; 0 when the ledger is "
        "consistent.",
        (),
    ),
    MetricSpec(
        "kvledger_tp_exchanges_total",
        "counter",
        "Collectives this TP rank took part in with the others (page changes and checks); "
        "exported only by pools under tensor parallelism.",
        (),
    ),
    MetricSpec(
        "kvledger_tp_page_ops_total",
        "counter",
        "Page ids mapped or unmapped as rank 0 decided at those exchanges.",
        (),
    ),
    MetricSpec(
        "kvledger_tp_divergences_total",
        "counter",
        "Exchanges at which some rank's allocation sequence differed from rank 0's; the pool "
        "refuses further work after one (the debug endpoint shows both views).",
        (),
    ),
    MetricSpec(
        "kvledger_tp_peer_failures_total",
        "counter",
        "Exchanges that failed because a rank died or did not answer within the timeout.",
        (),
    ),
    MetricSpec(
        "kvledger_pages_mapped_total",
        "counter",
        "Page ids mapped by the VMM allocator (one page id is one page in every layer buffer "
        "of the pool).",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_pages_unmapped_total",
        "counter",
        "Page ids unmapped by the VMM allocator (one page id is one page in every layer buffer "
        "of the pool).",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_map_calls_total",
        "counter",
        "Map operations of the VMM allocator (each maps one or more page ids).",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_map_seconds_total",
        "counter",
        "Seconds the VMM allocator spent mapping pages (create, map and set-access), all layers.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_unmap_seconds_total",
        "counter",
        "Seconds the VMM allocator spent unmapping pages, all layers.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_allocator_failures_total",
        "counter",
        "Driver or OS calls of the VMM allocator that failed (map, unmap, create, release) at "
        "a limit such as the process's map count, the file-size limit or device memory; the "
        "allocation failed cleanly or the unmap is retried, nothing held was leaked.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_map_page_seconds",
        "histogram",
        "Seconds per page id of the VMM allocator's map operations: each page id an operation "
        "mapped observes the operation's time divided by its page ids, so _count is the page "
        "ids mapped and _sum the seconds spent mapping; buckets "
        + ", ".join(f"{b:g}" for b in MAP_SECONDS_BUCKETS)
        + " s.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_handle_pages",
        "gauge",
        "Page ids of the VMM pool whose physical handles are alive, mapped or kept spare.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_mapped_pages",
        "gauge",
        "Page ids of the VMM pool mapped into the buffers' address ranges.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_peak_handle_pages",
        "gauge",
        "Most page ids with live physical handles at once since the pool started.",
        _ACCOUNT,
    ),
    MetricSpec(
        "kvledger_peak_occupied_slots",
        "gauge",
        "Most slots occupied at once since the account was registered.",
        _ACCOUNT,
    ),
    MetricSpec(
        BUILD_INFO,
        "gauge",
        "Always 1: the kvledger version serving, and the Python it runs on, as labels (like "
        "node_exporter's node_exporter_build_info); join on instance to see what each exporter "
        "runs.",
        ("version", "python_version"),
        engine=False,
    ),
    MetricSpec(
        "kvledger_sources_unreadable",
        "gauge",
        "Files in the snapshot directory that are not served, now (refused for a reason "
        "counted in kvledger_snapshot_file_errors_total; /debug/kv lists each with why).",
        (),
        engine=False,
    ),
    MetricSpec(
        "kvledger_snapshot_dir_usable",
        "gauge",
        "1 while the snapshot directory is open, meets the rules (docs/security.md) and "
        "takes a file; 0 while it is missing, unreadable or refused (replaced by another "
        "user's, say: the sources it served are then listed with kvledger_up 0), or while no "
        "publisher can write there: "
        + ", ".join(DIRECTORY_REASONS)
        + " (a read-only mount, no write permission for this user, no inode left, no room "
        "for a file: each source that goes down meanwhile has it as its "
        "kvledger_source_last_error). /debug/kv's files_not_served names why. 1 for an "
        "exporter with no directory.",
        (),
        engine=False,
    ),
    MetricSpec(
        "kvledger_snapshot_file_errors_total",
        "counter",
        "Snapshot files refused since the exporter started, per reason (each version of a "
        "file counted once): symlink, not_regular, owner, too_large, open, parse, nesting, "
        "schema, too_many_files; buffers: a served file's buffer rows failed their checks when "
        "/debug/kv read them (its metrics, from the checked first line, are still served). "
        "/debug/kv names the files.",
        ("reason",),
        engine=False,
    ),
    MetricSpec(
        "kvledger_connections_closed_total",
        "counter",
        "Client connections kvledger serve closed or refused since it started, per reason: "
        "request_timeout (no complete request head in --request-timeout), evicted (closed to "
        "make room past --max-connections, having waited longest), refused (503: past "
        "--max-connections with every connection being answered), too_many_headers (431), "
        "bad_request (400: malformed, or a head over --max-header-bytes). "
        "Absent when the exporter runs inside an engine's server.",
        ("reason",),
        engine=False,
    ),
    MetricSpec(
        "kvledger_source_errors_total",
        "counter",
        "Times a source was left out of a scrape since the exporter started, per reason: "
        "snapshot (an in-process ledger's snapshot failed), render (building a source's "
        "series failed; counted once per published snapshot). The other sources are served; "
        "the log names the source (at most one line a minute per source).",
        ("reason",),
        engine=False,
    ),
)

# Exported only by a source whose device truth is a GPU read through NVML (none on the host
# backend): the dashboard's "Where the GPU went" row is empty without a GPU.
GPU_ONLY: frozenset[str] = frozenset(
    ("kvledger_gpu_memory_bytes", "kvledger_gpu_memory_total_bytes")
)

# The exporter's own metrics; METRICS adds those of the registered engine exports.
CORE_METRICS: tuple[MetricSpec, ...] = METRICS
METRIC: dict[str, MetricSpec] = {m.name: m for m in METRICS}
if len(METRIC) != len(METRICS):  # pragma: no cover - a table edit gone wrong
    raise RuntimeError("exporter.metrics: a metric name is declared twice")


def register(specs: Iterable[MetricSpec]) -> None:
    """Add an engine export's metrics to the table (`exporter.engines.register` calls it);
    a name already declared raises, and nothing is added."""
    global METRICS, METRIC
    new = tuple(specs)
    names = [s.name for s in new]
    taken = sorted({n for n in names if n in METRIC or names.count(n) > 1})
    if taken:
        raise ValueError(f"metrics {taken} are declared already")
    METRICS = (*METRICS, *new)
    METRIC = {**METRIC, **{s.name: s for s in new}}


def series_names() -> frozenset[str]:
    """Every series name Prometheus can store from this exporter."""
    return frozenset(n for m in METRICS for n in m.sample_names)


def markdown_table(specs: Iterable[MetricSpec] | None = None) -> str:
    """The metric table as Markdown (docs/metrics.md embeds the exporter's own metrics; a
    test keeps them equal): `specs`, by default every metric declared here."""
    rows = ["| metric | type | labels | help |", "|---|---|---|---|"]
    for s in CORE_METRICS if specs is None else specs:
        labels = [*ENGINE_LABELS, "[dp_rank]", "[UUID]", "[gpu]"] if s.engine else []
        labels += list(s.labels)
        if s.type == "histogram":
            labels.append("le")
        shown = ", ".join(f"`{x}`" for x in labels) or "(none)"
        rows.append(f"| `{s.name}` | {s.type} | {shown} | {s.help.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
