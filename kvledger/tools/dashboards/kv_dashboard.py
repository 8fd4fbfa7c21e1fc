"""The KV-cache memory dashboard: where the KV cache's device memory went, and whether it comes back.

Rows: the headline per rank; the figures per family side by side; where the
bytes go (idle physical, unbacked address space); where the GPU went (every part of
the device's used memory, accounting.gpu_parts, stacked per rank); occupancy; allocator activity
(page maps, unmaps, map latency); reconciliation and source health; fleet totals
by model and family. Figure panels are generated from `accounting.figures.FIGURES`.

Filters: `instance` (exporter targets), `model_name`, `tp_rank`, `family`. Stacking
is used only where the stacked series add up to something real: one figure over
families or models (bytes add up over buffers), never different figures, and
never slot counts of different families (a token, a compressed row and a state
row are different things).
"""

from __future__ import annotations

from accounting.figures import FIGURES, figure
from exporter import metrics as m
from kvledger.engines.vllm import metrics as vllm_metrics
from kvledger.tools.dashboards import rules as r
from kvledger.tools.dashboards.grafana import Dashboard, Panel, Row, Target, Variable

UID = "kvledger-kv-cache"
PROVISIONED_DATASOURCE = "kvledger-prometheus"  # dashboards/grafana/provisioning/datasources
SEL = 'instance=~"$instance", model_name=~"$model_name", tp_rank=~"$tp_rank"'
FAM = SEL + ', family=~"$family"'
FLEET_SEL = 'model_name=~"$model_name", family=~"$family"'
RATE = "$__rate_interval"
RANK_LEGEND = "{{model_name}} tp{{tp_rank}} pp{{pp_rank}} @ {{instance}}"
BYTES = "bytes"  # Grafana's IEC bytes (KiB, MiB, GiB)
GIB = "gbytes"  # Grafana's gibibytes: the unit of sglang:kv_cache_memory_usage_gb (bytes / 2^30)
RATIO = "percentunit"
UP_MAPPINGS = (
    {
        "type": "value",
        "options": {
            "0": {"text": "stale", "color": "red", "index": 0},
            "1": {"text": "up", "color": "green", "index": 1},
        },
    },
)


def _help(name: str) -> str:
    return m.METRIC[name].help


def _by_family(name: str, sel: str = FAM) -> str:
    return f"sum by (family) ({name}{{{sel}}})"


def headline_row() -> Row:
    name = r.metric(m.HEADLINE)
    return Row(
        "Headline: sglang:kv_cache_memory_usage_gb",
        (
            Panel(
                "KV-cache device memory (selected ranks)",
                f"Sum of {name} over the selected instances, models and ranks. {_help(name)}",
                (Target(f"sum({name}{{{SEL}}})", "device memory"),),
                GIB,
                kind="stat",
                width=6,
            ),
            Panel(
                "KV-cache device memory per rank",
                f"{name} per engine rank, one line per model / tp_rank / pp_rank / instance. "
                f"{_help(name)} Not 0 for a running DeepSeek-V4 pool.",
                (Target(f"{name}{{{SEL}}}", RANK_LEGEND),),
                GIB,
                width=18,
            ),
        ),
    )


def _widths(n: int) -> list[int]:
    """Grid widths for n panels: rows of three, the last row's panels sharing its width."""
    full, rest = divmod(n, 3)
    return [8] * (3 * full) + [24 // rest] * rest if rest else [8] * n


def figures_rows() -> tuple[tuple[Row, Row], tuple[Panel, ...]]:
    byte_figures = [f for f in FIGURES if f.unit == "bytes"]
    side_by_side = Panel(
        "$family: figures side by side",
        "One panel per family (repeated over the family variable): each bytes figure of the "
        "family as its own line, summed over the selected ranks. Never stacked: the figures "
        "are different kinds of memory and are never summed into one another. "
        + " ".join(f"{f.name}: {f.meaning}." for f in byte_figures),
        tuple(
            Target(
                f'sum by (family) ({r.fig(f.name)}{{{SEL}, family=~"$family"}})',
                f.name,
            )
            for f in byte_figures
        ),
        BYTES,
        width=8,
        repeat="family",
    )
    stacked = tuple(
        Panel(
            f"{f.name} by family (stacked)",
            f"{r.fig(f.name)} summed over the selected ranks, stacked by family: the families' "
            f"{f.name} add up to the ranks' total {f.name}. {f.name}: {f.meaning}. "
            f"Relation: {f.relation}.",
            (Target(_by_family(r.fig(f.name)), "{{family}}"),),
            BYTES,
            stack=True,
            width=width,
        )
        for f, width in zip(byte_figures, _widths(len(byte_figures)), strict=True)
    )
    slots = tuple(
        Panel(
            f"{f.name} per family",
            f"{r.fig(f.name)} per family, summed over the selected ranks. Not stacked: "
            "families count different entries (tokens, compressed rows, state rows), so their "
            f"slots do not add up. {f.name}: {f.meaning}.",
            (Target(_by_family(r.fig(f.name)), "{{family}}"),),
            "short",
            axis_label="slots",
            width=12,
        )
        for f in FIGURES
        if f.unit == "slots"
    )
    return (
        Row("Each family's figures side by side (one panel per family)", (side_by_side,)),
        Row("Figures by family, stacked (tensor, reserved, physical, mapped, occupied)", stacked),
    ), slots


def where_row() -> Row:
    idle, unbacked = r.IDLE_PHYSICAL, r.UNBACKED_RESERVED
    phys, occ = r.fig("physical_bytes"), r.fig("occupied_bytes")
    res = r.fig("reserved_bytes")
    return Row(
        "Where the bytes go: physical vs occupied, reserved vs physical",
        (
            Panel(
                "Physical vs occupied per family",
                f"{phys} and {occ} per family, summed over the selected ranks. The gap is "
                "device memory held for the family that holds no live token or row. Not "
                "stacked: two different figures.",
                (
                    Target(_by_family(phys), "{{family}} physical"),
                    Target(_by_family(occ), "{{family}} occupied"),
                ),
                BYTES,
                width=12,
            ),
            Panel(
                "Reserved vs physical per family",
                f"{res} and {phys} per family, summed over the selected ranks. The gap is "
                "reserved address space with no device memory behind it (a VMM family's room "
                "to grow); for a runtime-owned family the two are equal. Not stacked: two "
                "different figures.",
                (
                    Target(_by_family(res), "{{family}} reserved"),
                    Target(_by_family(phys), "{{family}} physical"),
                ),
                BYTES,
                width=12,
            ),
            Panel(
                "Backed but idle (physical - occupied) by family",
                f"{idle.record} (recording rule: {idle.expr}), stacked by family: {idle.help}.",
                (Target(_by_family(idle.record), "{{family}}"),),
                BYTES,
                stack=True,
                width=12,
            ),
            Panel(
                "Unbacked address space (reserved - physical) by family",
                f"{unbacked.record} (recording rule: {unbacked.expr}), stacked by family: "
                f"{unbacked.help}. Address space costs no device memory; a VMM family's "
                "physical bytes grow into it as requests arrive.",
                (Target(_by_family(unbacked.record), "{{family}}"),),
                BYTES,
                stack=True,
                width=12,
            ),
        ),
    )


def gpu_row() -> Row:
    parts, total = (
        r.metric("kvledger_gpu_memory_bytes"),
        r.metric("kvledger_gpu_memory_total_bytes"),
    )
    return Row(
        "Where the GPU went",
        (
            Panel(
                "GPU memory by part, rank $tp_rank",
                f"{parts} stacked by part for one rank's GPU (one copy of the panel per "
                "selected rank): the stack reaches NVML's device-wide used memory at every "
                f"publish; the line is the device's size ({total}). {_help(parts)}",
                (
                    Target(f"sum by (part) ({parts}{{{SEL}}})", "{{part}}"),
                    Target(f"max({total}{{{SEL}}})", "device total (NVML)"),
                ),
                BYTES,
                stack=True,
                width=16,
                height=9,
                repeat="tp_rank",
                lines="^device total",
            ),
            Panel(
                "Now, by part and rank",
                f"The latest {parts} per rank and part, largest first. A growing "
                "outside_torch is memory taken outside torch's allocator (communication "
                "buffers, a library's cuMemAlloc); unattributed is 0 where NVML lists the "
                "process, and growth since the last named point where it does not (basis "
                "device, /debug/kv).",
                (
                    Target(
                        f"sort_desc(sum by (tp_rank, part) ({parts}{{{SEL}}}))",
                        "tp{{tp_rank}} {{part}}",
                        instant=True,
                    ),
                ),
                BYTES,
                kind="bargauge",
                width=8,
                height=9,
            ),
        ),
    )


def _ratio(num: str, den: str) -> str:
    return f"{_by_family(num)} / ({_by_family(den)} > 0)"


def occupancy_row(slots: tuple[Panel, ...]) -> Row:
    occ_s, cap_s = r.fig("occupied_slots"), r.fig("capacity_slots")
    occ_b, phys, res = r.fig("occupied_bytes"), r.fig("physical_bytes"), r.fig("reserved_bytes")
    return Row(
        "Occupancy: slots and ratios",
        (
            *slots,
            Panel(
                "Slot occupancy per family",
                f"sum({occ_s}) / sum({cap_s}) per family over the selected ranks: the share of "
                f"the family's slots held by live requests. {figure('capacity_slots').meaning}.",
                (Target(_ratio(occ_s, cap_s), "{{family}}"),),
                RATIO,
                min=0,
                max=1,
            ),
            Panel(
                "Physical memory holding live entries (occupied / physical)",
                f"sum({occ_b}) / sum({phys}) per family: the share of the family's device "
                "memory that holds live entries. Low values mean memory is held but idle "
                "(spare pages, partly filled pages, padding).",
                (Target(_ratio(occ_b, phys), "{{family}}"),),
                RATIO,
                min=0,
                max=1,
            ),
            Panel(
                "Backed share of the reservation (physical / reserved)",
                f"sum({phys}) / sum({res}) per family: 1 for runtime-owned tensors; for a VMM "
                "family, how close its physical memory is to the most its reservation can "
                f"back (alert KvCachePhysicalNearBudget fires above {r.NEAR_BUDGET_RATIO:.0%}).",
                (Target(_ratio(phys, res), "{{family}}"),),
                RATIO,
                min=0,
                max=1,
                thresholds=((None, "green"), (r.NEAR_BUDGET_RATIO, "orange")),
            ),
        ),
    )


def holders_row() -> Row:
    """Who holds the KV cache: per family the holders stacked (they add up to occupied
    bytes), the binding family, and the eviction rates."""
    from accounting.figures import HOLDER_PRECEDENCE, HOLDERS

    held = r.metric(m.HELD_BYTES)
    meanings = " ".join(f"{h.name}: {h.meaning}." for h in HOLDERS)
    return Row(
        "Who holds the KV cache",
        (
            Panel(
                "$family: occupied bytes by holder (stacked)",
                f"{held} of the family, stacked by holder, summed over the selected ranks: the "
                f"holders add up to the family's occupied bytes. {HOLDER_PRECEDENCE}. {meanings}",
                (
                    Target(
                        f'sum by (holder) ({held}{{{SEL}, family=~"$family"}})',
                        "{{holder}}",
                    ),
                ),
                BYTES,
                stack=True,
                width=8,
                repeat="family",
            ),
            Panel(
                "Unreclaimable share per family (the binding constraint)",
                f"{r.UNRECLAIMABLE.help}. Alert KvCacheNonFullFamilyBinding fires when a family "
                f"other than the full-token ones passes {r.BINDING_RATIO:.0%} (or evicts "
                f"prefixes) while the full family is under {1 - r.FULL_ROOM_RATIO:.0%} occupied.",
                (
                    Target(
                        f"max by (family) ({r.UNRECLAIMABLE.record}{{{FAM}}})",
                        "{{family}}",
                    ),
                ),
                RATIO,
                min=0,
                max=1,
                thresholds=((None, "green"), (r.BINDING_RATIO, "red")),
                width=8,
            ),
            Panel(
                "Prefix-tree and window evictions per family",
                f"{r.EVICTED_RATE.help} (prefix), and {r.WINDOW_EVICTED_RATE.help} (window), "
                "summed over the selected ranks. Prefix evictions in one family while the "
                "others have room mean that family is too small.",
                (
                    Target(_by_family(r.EVICTED_RATE.record), "{{family}} prefix"),
                    Target(_by_family(r.WINDOW_EVICTED_RATE.record), "{{family}} window"),
                ),
                "short",
                axis_label="slots / s",
                width=8,
            ),
            Panel(
                "Requests retracted for lack of KV",
                f"rate of {r.metric('sglang:kv_cache_retracted_requests_total')}: running "
                "requests sent back to the queue, their KV freed, because the cache had no "
                "room for their next tokens.",
                (
                    Target(
                        f"sum(rate({r.metric('sglang:kv_cache_retracted_requests_total')}"
                        f"{{{SEL}}}[{RATE}]))",
                        "retracted / s",
                    ),
                ),
                "short",
                axis_label="requests / s",
                width=12,
            ),
            Panel(
                "KV bytes per running request (median, 90th percentile)",
                "Quantiles of sglang:kv_cache_request_bytes over the running requests of the "
                "selected ranks: the KV bytes one request holds, all families together. "
                "/debug/kv lists the largest requests by id.",
                tuple(
                    Target(
                        f"histogram_quantile({q}, sum by (le) "
                        f"({r.metric('sglang:kv_cache_request_bytes_bucket')}{{{SEL}}}))",
                        f"p{int(q * 100)}",
                    )
                    for q in (0.5, 0.9)
                ),
                BYTES,
                width=12,
            ),
        ),
    )


def allocator_row() -> Row:
    mapped, unmapped = (
        r.metric("kvledger_pages_mapped_total"),
        r.metric("kvledger_pages_unmapped_total"),
    )
    bucket = r.metric("kvledger_map_page_seconds_bucket")
    map_s, unmap_s = (
        r.metric("kvledger_map_seconds_total"),
        r.metric("kvledger_unmap_seconds_total"),
    )
    handles, mapped_pages = r.metric("kvledger_handle_pages"), r.metric("kvledger_mapped_pages")
    quantiles = (0.5, 0.9, 0.99)
    return Row(
        "VMM allocator: page maps, unmaps and map latency",
        (
            Panel(
                "Page ids mapped / unmapped per second",
                f"rate({mapped}) above the axis and rate({unmapped}) below it, per family, over "
                f"$__rate_interval. {_help(mapped)} Pages coming back (unmaps) is memory "
                "returned as requests leave the sliding window or finish.",
                (
                    Target(
                        f"sum by (family) (rate({mapped}{{{FAM}}}[{RATE}]))", "{{family}} mapped"
                    ),
                    Target(
                        f"sum by (family) (rate({unmapped}{{{FAM}}}[{RATE}]))",
                        "{{family}} unmapped",
                    ),
                ),
                "short",
                width=12,
                axis_label="page ids / s",
                negative_y=".*unmapped",
            ),
            Panel(
                "Map latency per page id (p50, p90, p99)",
                "histogram_quantile over rate(kvledger_map_page_seconds_bucket[$__rate_interval]), "
                f"per family. {_help('kvledger_map_page_seconds')}",
                tuple(
                    Target(
                        f"histogram_quantile({q}, sum by (le, family) "
                        f"(rate({bucket}{{{FAM}}}[{RATE}])))",
                        f"{{{{family}}}} p{round(q * 100)}",
                    )
                    for q in quantiles
                ),
                "s",
                width=12,
            ),
            Panel(
                "Mean map / unmap time per page id",
                f"rate({map_s}) / rate({mapped}) and rate({unmap_s}) / rate({unmapped}) per "
                "family: seconds spent per page id mapped (create, map, set-access) and "
                "unmapped, all layers.",
                (
                    Target(
                        f"sum by (family) (rate({map_s}{{{FAM}}}[{RATE}])) / "
                        f"sum by (family) (rate({mapped}{{{FAM}}}[{RATE}]))",
                        "{{family}} map",
                    ),
                    Target(
                        f"sum by (family) (rate({unmap_s}{{{FAM}}}[{RATE}])) / "
                        f"sum by (family) (rate({unmapped}{{{FAM}}}[{RATE}]))",
                        "{{family}} unmap",
                    ),
                ),
                "s",
                width=12,
            ),
            Panel(
                "Page ids with physical handles vs mapped",
                f"{handles} and {mapped_pages} per family; the difference is spare pages whose "
                "handles are kept (they still hold device memory) for fast reuse. "
                f"{_help(handles)}",
                (
                    Target(_by_family(handles), "{{family}} handles"),
                    Target(_by_family(mapped_pages), "{{family}} mapped"),
                ),
                "short",
                width=12,
                axis_label="page ids",
            ),
        ),
    )


def health_row() -> Row:
    unattr, truth = r.metric("kvledger_unattributed_bytes"), r.metric("kvledger_truth_bytes")
    up, age = r.metric("kvledger_up"), r.metric("kvledger_snapshot_age_seconds")
    viol = r.metric("kvledger_relation_violations")
    source_legend = "{{source}} tp{{tp_rank}} @ {{instance}}"
    return Row(
        "Reconciliation and source health",
        (
            Panel(
                "Unattributed bytes (device truth - ledger)",
                f"{_help(unattr)} Alert KvCacheUnattributedBytes fires beyond "
                f"{r.UNATTRIBUTED_BYTES // 2**20} MiB either way.",
                (Target(f"{unattr}{{{SEL}}}", "{{truth}} tp{{tp_rank}} @ {{instance}}"),),
                BYTES,
                thresholds=((None, "green"), (r.UNATTRIBUTED_BYTES, "red")),
            ),
            Panel(
                "Device truth vs ledger VMM physical bytes",
                f"{truth} per truth source next to the ledger figure it is reconciled with: the "
                f"physical bytes of the VMM-owned families ({r.fig('physical_bytes')} with "
                'owner="vmm"; accounting/reconcile.py). Runtime-owned tensors are not part of '
                f"either line, so the gap between the two is the unattributed bytes. {_help(truth)}",
                (
                    Target(f"{truth}{{{SEL}}}", "{{truth}} tp{{tp_rank}} @ {{instance}}"),
                    Target(
                        f"sum by (instance, model_name, tp_rank) "
                        f'({r.fig("physical_bytes")}{{{SEL}, owner="vmm"}})',
                        "ledger VMM physical tp{{tp_rank}} @ {{instance}}",
                    ),
                ),
                BYTES,
            ),
            Panel(
                "Device truth readable",
                f"{_help(r.metric('kvledger_truth_available'))}",
                (
                    Target(
                        f"{r.metric('kvledger_truth_available')}{{{SEL}}}",
                        "{{truth}} tp{{tp_rank}} @ {{instance}}",
                    ),
                ),
                "none",
                kind="stat",
                width=8,
                mappings=(
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "unreadable", "color": "orange", "index": 0},
                            "1": {"text": "read", "color": "green", "index": 1},
                        },
                    },
                ),
                thresholds=((None, "orange"), (1, "green")),
            ),
            Panel(
                "Relation violations",
                f"{_help(viol)} Anything above 0 is a bug in an allocator's reports; /debug/kv "
                "lists each violation.",
                (Target(f"sum({viol}{{{SEL}}})", "violations"),),
                "short",
                kind="stat",
                width=4,
                thresholds=((None, "green"), (1, "red")),
            ),
            Panel(
                "Sources up",
                f"{_help(up)} One value per source (engine process).",
                (Target(f"{up}{{{SEL}}}", source_legend),),
                "none",
                kind="stat",
                width=10,
                mappings=UP_MAPPINGS,
                thresholds=((None, "red"), (1, "green")),
            ),
            Panel(
                "Snapshot age",
                f"{_help(age)} Alert KvLedgerSnapshotStale fires above {r.STALE_AGE_SECONDS} s.",
                (Target(f"{age}{{{SEL}}}", source_legend),),
                "s",
                width=10,
                thresholds=((None, "green"), (r.STALE_AGE_SECONDS, "red")),
            ),
        ),
    )


def fleet_row() -> Row:
    phys_fleet = r.fleet_figure("physical_bytes")
    return Row(
        "Fleet: all instances and ranks, by model and family",
        (
            Panel(
                "KV-cache device memory by model",
                f"{r.FLEET_HEADLINE.record} (recording rule: {r.FLEET_HEADLINE.expr}), stacked: "
                "models' device memory adds up to the fleet's. Filters: model_name only.",
                (
                    Target(
                        f'{r.FLEET_HEADLINE.record}{{model_name=~"$model_name"}}', "{{model_name}}"
                    ),
                ),
                GIB,
                stack=True,
            ),
            Panel(
                "Physical bytes by family, whole fleet",
                f"sum by (family) of {phys_fleet} (recording rule: sum by (model_name, family) "
                f"of {r.fig('physical_bytes')}), stacked by family. Filters: model_name, family.",
                (Target(f"sum by (family) ({phys_fleet}{{{FLEET_SEL}}})", "{{family}}"),),
                BYTES,
                stack=True,
            ),
            Panel(
                "Backed but idle by model and family",
                f"{r.FLEET_IDLE.record}: {r.FLEET_IDLE.help}. Stacked. Filters: model_name, family.",
                (Target(f"{r.FLEET_IDLE.record}{{{FLEET_SEL}}}", "{{model_name}} {{family}}"),),
                BYTES,
                stack=True,
            ),
            Panel(
                "Slot occupancy by model and family",
                f"{r.FLEET_SLOT_OCCUPANCY.record}: {r.FLEET_SLOT_OCCUPANCY.help}.",
                (
                    Target(
                        f"{r.FLEET_SLOT_OCCUPANCY.record}{{{FLEET_SEL}}}",
                        "{{model_name}} {{family}}",
                    ),
                ),
                RATIO,
                min=0,
                max=1,
            ),
            Panel(
                "Live sources by model",
                f"{r.FLEET_SOURCES_UP.record}: {r.FLEET_SOURCES_UP.help} (engine processes "
                "publishing to an exporter; one per rank).",
                (
                    Target(
                        f'{r.FLEET_SOURCES_UP.record}{{model_name=~"$model_name"}}',
                        "{{model_name}}",
                    ),
                ),
                "short",
                width=8,
            ),
            Panel(
                "Tensor vs physical bytes by model",
                f"{r.fleet_figure('tensor_bytes')} and {phys_fleet} summed per model: what the "
                "pools hand to the model (full virtual extent) against the device memory "
                "behind it. Not stacked: two different figures.",
                (
                    Target(
                        f"sum by (model_name) ({r.fleet_figure('tensor_bytes')}{{{FLEET_SEL}}})",
                        "{{model_name}} tensor",
                    ),
                    Target(
                        f"sum by (model_name) ({phys_fleet}{{{FLEET_SEL}}})",
                        "{{model_name}} physical",
                    ),
                ),
                BYTES,
            ),
        ),
    )


VSEL = 'instance=~"$instance", model_name=~"$model_name"'
WORKER_LEGEND = "{{model_name}} engine {{engine}} tp{{tp_rank}} pp{{pp_rank}}"
GROUP_LEGEND = "g{{group}} {{kind}} engine {{engine}} tp{{tp_rank}}"


def _v(name: str) -> str:
    return r.metric(vllm_metrics.PREFIX + name)


def vllm_row() -> Row:
    """vLLM engines (kvledger.engines.vllm): a worker's bytes per KV-cache group and the engine
    core's blocks, joined on vLLM's labels (`model_name`, `engine`, `group`)."""
    occ, slot = _v("group_occupied_slots"), _v("group_slot_bytes")
    free, block = _v("free_blocks"), _v("kv_block_bytes")
    return Row(
        "vLLM: KV-cache groups (tensor bytes per worker, blocks per engine)",
        (
            Panel(
                "vLLM: KV storage per worker",
                f"{_v('kv_cache_physical_bytes')} per worker: the one KV buffer vLLM allocates "
                f"for all groups, counted once. {_help(_v('kv_cache_physical_bytes'))}",
                (Target(f"{_v('kv_cache_physical_bytes')}{{{VSEL}}}", WORKER_LEGEND),),
                BYTES,
            ),
            Panel(
                "vLLM: bytes per token, per group",
                f"{slot} per worker and KV-cache group: what one token (a state, for a Mamba "
                "group) costs in the group's layers; groups differ (DeepSeek-V4's five, vLLM "
                f"#51041). {_help(slot)}",
                (Target(f"{slot}{{{VSEL}}}", GROUP_LEGEND),),
                BYTES,
            ),
            Panel(
                "vLLM: bytes each group addresses",
                f"{_v('group_tensor_bytes')}: the group's layer views. Groups alias one storage, "
                f"so these do not add up to it (not stacked). {_help(_v('group_tensor_bytes'))}",
                (Target(f"{_v('group_tensor_bytes')}{{{VSEL}}}", GROUP_LEGEND),),
                BYTES,
            ),
            Panel(
                "vLLM: blocks per engine (occupied, evictable, free)",
                "The engine core's block pool, shared by every group: blocks in use, free blocks "
                "still holding a cached prefix (evictable, a subset of free), and free blocks. "
                f"{_help(_v('evictable_blocks'))}",
                (
                    Target(f"{_v('occupied_blocks')}{{{VSEL}}}", "occupied engine {{engine}}"),
                    Target(f"{_v('evictable_blocks')}{{{VSEL}}}", "evictable engine {{engine}}"),
                    Target(f"{free}{{{VSEL}}}", "free engine {{engine}}"),
                ),
                "short",
                axis_label="blocks",
            ),
            Panel(
                "vLLM: slot occupancy per group",
                f"{occ} / {_v('group_capacity_slots')} per engine and group: the share of the "
                "group's slots held by running requests.",
                (
                    Target(
                        f"{occ}{{{VSEL}}} / ({_v('group_capacity_slots')}{{{VSEL}}} > 0)",
                        "g{{group}} {{kind}} engine {{engine}}",
                    ),
                ),
                RATIO,
                min=0,
                max=1,
            ),
            Panel(
                "vLLM: occupied bytes per worker and group",
                f"The engine core's {occ} times each worker's {slot} (joined on model_name, "
                "engine, group): the bytes of each worker's KV storage holding running "
                "requests' entries, per group.",
                (
                    Target(
                        f"{occ}{{{VSEL}}} * on(model_name, engine, group) group_right "
                        f"{slot}{{{VSEL}}}",
                        GROUP_LEGEND,
                    ),
                ),
                BYTES,
                width=12,
            ),
            Panel(
                "vLLM: available KV memory per worker",
                f"The engine core's {free} times each worker's {block} (joined on model_name, "
                "engine): device memory new requests can take, cached prefixes included "
                "(vLLM #26850).",
                (
                    Target(
                        f"{free}{{{VSEL}}} * on(model_name, engine) group_right {block}{{{VSEL}}}",
                        WORKER_LEGEND,
                    ),
                ),
                BYTES,
                width=12,
            ),
            *_vllm_requests_panels(),
        ),
    )


def _vllm_requests_panels() -> tuple[Panel, ...]:
    """vLLM engine cores: each group's slots by holder, and the running requests'
    footprints (a histogram per group, in slots; bytes through the workers' slot bytes)."""
    held, slot = _v("group_held_slots"), _v("group_slot_bytes")
    buckets, total = _v("request_slots_bucket"), _v("request_slots_sum")
    by = "model_name, engine, group, kind"
    return (
        Panel(
            "vLLM: holders per group",
            f"{held} per engine and group: its slots in use split into tree_protected (in the "
            "prefix cache) and request_only (not cached), plus its free cached slots "
            "(tree_evictable, outside occupied); stacked, the first three make the group's "
            f"occupied slots. {_help(held)}",
            (Target(f"{held}{{{VSEL}}}", "g{{group}} {{kind}} {{holder}} engine {{engine}}"),),
            "short",
            stack=True,
            axis_label="slots",
        ),
        Panel(
            "vLLM: running requests' footprints per group",
            f"The engine core's running requests ({_v('running_requests')}) and, per group, "
            "the median and 99th percentile of one request's slots (tokens; states for a "
            "Mamba group), shared prefix blocks counted in every request that holds them.",
            (
                Target(f"{_v('running_requests')}{{{VSEL}}}", "running engine {{engine}}"),
                Target(
                    f"histogram_quantile(0.5, sum by ({by}, le) ({buckets}{{{VSEL}}}))",
                    "p50 g{{group}} {{kind}} engine {{engine}}",
                ),
                Target(
                    f"histogram_quantile(0.99, sum by ({by}, le) ({buckets}{{{VSEL}}}))",
                    "p99 g{{group}} {{kind}} engine {{engine}}",
                ),
            ),
            "short",
        ),
        Panel(
            "vLLM: running requests' bytes per worker and group",
            f"The engine core's {total} (every running request's slots in the group, shared "
            f"prefix blocks once per request holding them) times each worker's {slot}, "
            "joined on model_name, engine, group: the KV bytes the running requests reference "
            "on each worker. It can exceed the group's occupied bytes when requests share a "
            "prefix.",
            (
                Target(
                    f"{total}{{{VSEL}}} * on(model_name, engine, group) group_right "
                    f"{slot}{{{VSEL}}}",
                    GROUP_LEGEND,
                ),
            ),
            BYTES,
        ),
    )


def _values(label: str, series: str) -> str:
    return f"label_values({series}, {label})"


UP = "kvledger_up"
VARIABLES = (
    Variable(
        "datasource",
        "Data source",
        "The Prometheus that scrapes the kvledger exporters (default: the provisioned one)",
        PROVISIONED_DATASOURCE,
    ),
    Variable(
        "instance",
        "Instance",
        "kvledger exporter targets (one per node)",
        _values("instance", r.metric(UP)),
    ),
    Variable(
        "model_name",
        "Model",
        "SGLang's model_name label",
        _values("model_name", f'{r.metric(UP)}{{instance=~"$instance"}}'),
    ),
    Variable(
        "tp_rank",
        "TP rank",
        "Tensor-parallel rank (one engine process each)",
        _values("tp_rank", f'{r.metric(UP)}{{instance=~"$instance", model_name=~"$model_name"}}'),
    ),
    Variable(
        "family",
        "Family",
        "KV-cache buffer family (swa_kv, c4_kv, c128_kv, ...)",
        _values(
            "family",
            f'{r.fig("physical_bytes")}{{instance=~"$instance", model_name=~"$model_name"}}',
        ),
    ),
)


def dashboard() -> Dashboard:
    family_rows, slot_panels = figures_rows()
    return Dashboard(
        uid=UID,
        title="kvledger: KV-cache memory",
        description="Where the KV cache's device memory went, per family and rank, and whether it "
        "comes back: tensor, reserved, physical and occupied figures kept apart "
        "(generated by kvledger dashboards; do not edit by hand).",
        tags=("kvledger", "sglang", "kv-cache"),
        variables=VARIABLES,
        rows=(
            headline_row(),
            *family_rows,
            where_row(),
            gpu_row(),
            occupancy_row(slot_panels),
            holders_row(),
            allocator_row(),
            health_row(),
            fleet_row(),
            vllm_row(),
        ),
    )
