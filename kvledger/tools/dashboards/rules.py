"""Prometheus recording rules (the per-family views the dashboard reads) and alerting rules.

Every exported name goes through `metric()`, which looks it up in the exporter's
table (`exporter.metrics.METRIC`) and raises for a name the exporter does not
export. Recorded names follow Prometheus's `level:metric:operations` convention.

Per-series views keep every label of their inputs (engine labels, `family`,
`owner`, `instance`, `job`), so the dashboard filters them like the raw gauges.
Fleet views aggregate to `model_name` and `family` (all instances and ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accounting.figures import FIGURES
from exporter import metrics as m

GIB = 2**30


def metric(name: str) -> str:
    """`name`, checked against the exporter's metric table (a series name for histograms)."""
    if name in m.METRIC:
        return name
    for spec in m.METRICS:
        if name in spec.sample_names:
            return name
    raise KeyError(f"metric {name!r} is not exported by kvledger (exporter.metrics.METRICS)")


def fig(figure_name: str) -> str:
    """The per-family gauge of a figure, e.g. sglang:kv_cache_physical_bytes."""
    return metric(m.figure_metric(figure_name))


BYTE_FIGURES: tuple[str, ...] = tuple(f.name for f in FIGURES if f.unit == "bytes")
SLOT_FIGURES: tuple[str, ...] = tuple(f.name for f in FIGURES if f.unit == "slots")


@dataclass(frozen=True)
class Recorded:
    record: str
    expr: str
    help: str  # for the dashboard's descriptions and the rule file's comments

    def to_rule(self) -> dict[str, Any]:
        return {"record": self.record, "expr": self.expr}


# -- per-series views (labels kept) ---------------------------------------------------------
IDLE_PHYSICAL = Recorded(
    "kvledger:kv_cache_idle_physical_bytes",
    f"{fig('physical_bytes')} - {fig('occupied_bytes')}",
    "physical_bytes - occupied_bytes: device memory held for the family that holds no live "
    "request's entry (spare handles, mapped but empty slots, page padding)",
)
UNBACKED_RESERVED = Recorded(
    "kvledger:kv_cache_unbacked_reserved_bytes",
    f"{fig('reserved_bytes')} - {fig('physical_bytes')}",
    "reserved_bytes - physical_bytes: virtual address space reserved for the family with no "
    "physical memory behind it (0 for runtime-owned tensors)",
)
SLOT_OCCUPANCY = Recorded(
    "kvledger:kv_cache_slot_occupancy:ratio",
    f"{fig('occupied_slots')} / ({fig('capacity_slots')} > 0)",
    "occupied_slots / capacity_slots: the share of the family's slots held by live requests",
)
BYTES_OCCUPANCY = Recorded(
    "kvledger:kv_cache_physical_occupancy:ratio",
    f"{fig('occupied_bytes')} / ({fig('physical_bytes')} > 0)",
    "occupied_bytes / physical_bytes: the share of the family's device memory holding live entries",
)
BACKED = Recorded(
    "kvledger:kv_cache_backed:ratio",
    f"{fig('physical_bytes')} / ({fig('reserved_bytes')} > 0)",
    "physical_bytes / reserved_bytes: the share of the family's address space backed by "
    "device memory (1 for runtime-owned tensors; for a VMM family, how close its physical "
    "memory is to the most it can back)",
)


def held(holder: str) -> str:
    """The held-slots gauge of one holder (accounting.figures.HOLDERS)."""
    from accounting.figures import HOLDER_NAMES

    if holder not in HOLDER_NAMES:
        raise KeyError(f"holder {holder!r}, expected one of {HOLDER_NAMES}")
    return f'{metric(m.HELD_SLOTS)}{{holder="{holder}"}}'


UNRECLAIMABLE = Recorded(
    "kvledger:kv_cache_unreclaimable:ratio",
    f"({fig('occupied_slots')} - ignoring(holder) {held('tree_evictable')})\n"
    f"  / ({fig('capacity_slots')} > 0)",
    "(occupied_slots - tree_evictable slots) / capacity_slots: the share of the family's slots "
    "that evicting every unlocked cached prefix would not free (held by running requests, "
    "locked in the tree, or of unknown holder). The family nearest 1 is the binding "
    "constraint: the next allocation fails there first",
)
EVICTED_RATE = Recorded(
    "kvledger:kv_cache_evicted_slots:rate5m",
    f"rate({metric('sglang:kv_cache_evicted_slots_total')}[5m])",
    "slots per second the prefix tree evicted from the family (cached prefixes lost, to be "
    "re-prefilled if asked for again), over 5 minutes",
)
WINDOW_EVICTED_RATE = Recorded(
    "kvledger:kv_cache_window_evicted_slots:rate5m",
    f"rate({metric('sglang:kv_cache_window_evicted_slots_total')}[5m])",
    "slots per second freed because they left a sliding window, over 5 minutes (routine, "
    "nothing reusable is lost)",
)
PER_SERIES: tuple[Recorded, ...] = (
    IDLE_PHYSICAL,
    UNBACKED_RESERVED,
    SLOT_OCCUPANCY,
    BYTES_OCCUPANCY,
    BACKED,
    UNRECLAIMABLE,
    EVICTED_RATE,
    WINDOW_EVICTED_RATE,
)


# -- fleet views (by model_name and family) ---------------------------------------------------
def fleet_figure(figure_name: str) -> str:
    return f"model_name_family:{fig(figure_name).replace(':', '_')}:sum"


FLEET_HEADLINE = Recorded(
    "model_name:sglang_kv_cache_memory_usage_gb:sum",
    f"sum by (model_name) ({metric(m.HEADLINE)})",
    "sglang:kv_cache_memory_usage_gb summed over every instance and rank of a model (GiB)",
)
FLEET_BYTES: tuple[Recorded, ...] = tuple(
    Recorded(
        fleet_figure(name),
        f"sum by (model_name, family) ({fig(name)})",
        f"{name} per model and family, summed over every instance and rank",
    )
    for name in BYTE_FIGURES
)
FLEET_IDLE = Recorded(
    "model_name_family:kvledger_kv_cache_idle_physical_bytes:sum",
    f"sum by (model_name, family) ({IDLE_PHYSICAL.expr})",
    "idle physical bytes (physical - occupied) per model and family, over every instance and rank",
)
FLEET_SLOT_OCCUPANCY = Recorded(
    "model_name_family:kvledger_kv_cache_slot_occupancy:ratio",
    f"sum by (model_name, family) ({fig('occupied_slots')})\n"
    f"  / (sum by (model_name, family) ({fig('capacity_slots')}) > 0)",
    "occupied_slots / capacity_slots per model and family, over every instance and rank",
)
FLEET_SOURCES_UP = Recorded(
    "model_name:kvledger_up:sum",
    f"sum by (model_name) ({metric('kvledger_up')})",
    "live kvledger sources (engine processes) per model",
)
FLEET: tuple[Recorded, ...] = (
    FLEET_HEADLINE,
    *FLEET_BYTES,
    FLEET_IDLE,
    FLEET_SLOT_OCCUPANCY,
    FLEET_SOURCES_UP,
)
RECORDED: tuple[Recorded, ...] = (*PER_SERIES, *FLEET)


def recording_rules() -> dict[str, Any]:
    return {
        "groups": [
            {"name": "kvledger_kv_cache_per_family", "rules": [r.to_rule() for r in PER_SERIES]},
            {"name": "kvledger_kv_cache_fleet", "rules": [r.to_rule() for r in FLEET]},
        ]
    }


# -- alerts -----------------------------------------------------------------------------------
# The families that count slots of the full-token space (the "full" family of the binding
# alert): DeepSeek-V4's compressed KV and indexer, an MHA or MLA pool's k / v / kv.
FULL_FAMILIES = ("c4_kv", "c128_kv", "c4_indexer", "k", "v", "kv")
BINDING_RATIO = 0.9  # a non-full family this full beyond what eviction reclaims ...
FULL_ROOM_RATIO = 0.5  # ... while the full family has more than this of its slots free
ENGINE_ON = "model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, instance"
NEAR_BUDGET_RATIO = 0.9
UNATTRIBUTED_BYTES = 256 * 2**20
STALE_AGE_SECONDS = 60
ENGINE = "{{ $labels.model_name }} tp_rank {{ $labels.tp_rank }} on {{ $labels.instance }}"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def to_rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


_FULL = "|".join(FULL_FAMILIES)
_NOT_FULL = "|".join((*FULL_FAMILIES, ".*_state"))  # state rings follow requests, not KV room
ALERTS: tuple[Alert, ...] = (
    Alert(
        "KvCacheNonFullFamilyBinding",
        f'(\n  {UNRECLAIMABLE.record}{{family!~"{_NOT_FULL}"}} > {BINDING_RATIO}\n'
        f'  or {EVICTED_RATE.record}{{family!~"{_NOT_FULL}"}} > 0\n)\n'
        f"and on({ENGINE_ON})\n"
        f'  max by ({ENGINE_ON}) ({SLOT_OCCUPANCY.record}{{family=~"{_FULL}"}}) '
        f"< {1 - FULL_ROOM_RATIO}",
        "5m",
        "warning",
        "KV-cache family {{ $labels.family }} is the binding constraint, not the full "
        "family (" + ENGINE + ")",
        f"The family is over {BINDING_RATIO:.0%} full beyond what evicting cached prefixes "
        "would free, or its prefixes are being evicted, while the full-token families have "
        f"more than {FULL_ROOM_RATIO:.0%} of their slots free: the engine's token gauges "
        "(which count the full pool) look healthy, yet requests wait or re-prefill their "
        "prefixes because this family has no room. Size it up (for DeepSeek-V4's SWA family: "
        "--swa-full-tokens-ratio), or see which requests hold it in /debug/kv.",
    ),
    Alert(
        "KvCachePhysicalNearBudget",
        f'{BACKED.record}{{owner="vmm"}} > {NEAR_BUDGET_RATIO}',
        "5m",
        "warning",
        "KV-cache family {{ $labels.family }} is backed to {{ $value | humanizePercentage }} "
        "of its reservation (" + ENGINE + ")",
        "The VMM family's physical bytes are above "
        f"{NEAR_BUDGET_RATIO:.0%} of its reserved bytes, the most device memory it can back: "
        "new pages will soon fail to map and requests will queue or be preempted. The "
        "exporter exports no separate physical budget, so the reservation is the ceiling "
        "used here.",
    ),
    Alert(
        "KvCacheUnattributedBytes",
        f"abs({metric('kvledger_unattributed_bytes')}) > {UNATTRIBUTED_BYTES}",
        "10m",
        "warning",
        "{{ $value | humanize1024 }}B of device memory unattributed by the KV ledger "
        "(truth {{ $labels.truth }}, " + ENGINE + ")",
        "Device truth ({{ $labels.truth }}) and the ledger's physical bytes differ by more "
        f"than {UNATTRIBUTED_BYTES // 2**20} MiB for 10 minutes: memory held that no buffer "
        "accounts for (a leaked handle, an allocation outside the ledger), or the ledger "
        "counting memory the device does not hold (negative values).",
    ),
    Alert(
        "KvLedgerSourceDown",
        f"{metric('kvledger_up')} == 0",
        "1m",
        "critical",
        "kvledger source {{ $labels.source }} stopped publishing (" + ENGINE + ")",
        "The engine process's publisher died or stopped without closing: its heartbeat is too "
        "old or its pid is gone. Its KV-cache figures are no longer exported.",
    ),
    Alert(
        "KvLedgerSnapshotStale",
        f"{metric('kvledger_snapshot_age_seconds')} > {STALE_AGE_SECONDS}",
        "2m",
        "warning",
        "kvledger snapshot of {{ $labels.source }} is {{ $value | humanizeDuration }} old "
        "(" + ENGINE + ")",
        f"The source's latest ledger snapshot is older than {STALE_AGE_SECONDS} s: the "
        "figures on the dashboard are not current.",
    ),
    Alert(
        "KvLedgerExporterDown",
        'up{job=~"kvledger.*"} == 0',
        "2m",
        "critical",
        "Prometheus cannot scrape the kvledger exporter on {{ $labels.instance }}",
        "The scrape of /metrics failed for 2 minutes: every KV-cache figure of that node is "
        "missing.",
    ),
    Alert(
        "KvLedgerRelationViolation",
        f"{metric('kvledger_relation_violations')} > 0",
        "1m",
        "critical",
        "{{ $value }} KV-cache ledger relation(s) broken (" + ENGINE + ")",
        "A snapshot broke a relation between figures (occupied <= mapped <= physical, mapped "
        "<= reserved, whole pages, nothing negative): an allocator reported events the ledger "
        "cannot reconcile. /debug/kv on the exporter lists each violation.",
    ),
    Alert(
        "KvLedgerTpDivergence",
        f"increase({metric('kvledger_tp_divergences_total')}[5m]) > 0",
        "0m",
        "critical",
        "TP rank {{ $labels.tp_rank }} diverged from rank 0 (" + ENGINE + ")",
        "A TP peer's allocation sequence no longer matched rank 0's at an exchange: the pool "
        "refused further work rather than write into the wrong slots. The engine's log and "
        "/debug/kv carry both ranks' views.",
    ),
    Alert(
        "KvLedgerTpPeerFailure",
        f"increase({metric('kvledger_tp_peer_failures_total')}[5m]) > 0",
        "0m",
        "critical",
        "TP rank {{ $labels.tp_rank }} lost a peer (" + ENGINE + ")",
        "An exchange between TP ranks failed: a rank died or did not answer within the "
        "timeout, and the surviving ranks stopped with an error instead of hanging.",
    ),
    Alert(
        "KvLedgerAllocatorFailures",
        f"increase({metric('kvledger_allocator_failures_total')}[5m]) > 0",
        "0m",
        "warning",
        "The VMM allocator of {{ $labels.family }} hits a driver or OS limit (" + ENGINE + ")",
        "Driver or OS calls of the VMM allocator failed in the last 5 minutes (the process's "
        "map count, the file-size limit or device memory): allocations that needed a new page "
        "failed and empty pages stay mapped until an unmap succeeds. The engine's log carries "
        "one line per interval with the count and the latest error.",
    ),
    Alert(
        "KvLedgerSnapshotDirUnusable",
        f"{metric('kvledger_snapshot_dir_usable')} == 0",
        "1m",
        "critical",
        "The kvledger snapshot directory on {{ $labels.instance }} is not usable",
        "The exporter's snapshot directory is missing, unreadable or refused (replaced by a "
        "directory another user controls, say): no engine's figures are read from it, and "
        "every source it served is listed down; or no engine can write there (a read-only "
        "mount, no write permission, no inode left, no room): each engine that goes down "
        "meanwhile shows the cause in kvledger_source_last_error{reason}. /debug/kv and "
        "/readyz on the exporter say why.",
    ),
    Alert(
        "KvLedgerConnectionsShed",
        f'increase({metric("kvledger_connections_closed_total")}{{reason=~"evicted|refused"}}[5m])'
        " > 0",
        "0m",
        "warning",
        "The kvledger exporter on {{ $labels.instance }} is shedding client connections "
        "({{ $labels.reason }})",
        "More clients held connections than --max-connections allows in the last 5 minutes: "
        "the ones waiting longest without a request were closed (evicted), or new ones "
        "refused with 503. A local client is holding connections open; scrapes are still "
        "answered.",
    ),
)

# Names Prometheus itself writes for every scrape, usable in rules next to the exporter's.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


def alerting_rules() -> dict[str, Any]:
    return {"groups": [{"name": "kvledger_alerts", "rules": [a.to_rule() for a in ALERTS]}]}
