"""What a scrape reads of one snapshot: everything but the buffer rows, typed.

A `Summary` is built once per snapshot: from a published file's first line when
it is checked (`accounting.snapfile.head.load`), or from a whole `Snapshot` by
`summary_of` (a ledger read in-process, or a file's buffer rows when someone asks
for its buffer map and they are held against the first line). The collector and
the debug view read its fields by name; nothing downstream reads the JSON.

The rows reuse accounting's own records (`AccountRow`, `Violation`, `TpStatus`,
`Figures`); what only a summary has is declared here: a family's rollup row and a
reconciliation result.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.buffers import Owner
from accounting.engine_state import EngineState
from accounting.figures import Figures, Held
from accounting.records import record_maker
from accounting.relations import Violation
from accounting.snapshot import AccountRow, Snapshot
from accounting.tp_status import TpStatus


@dataclass(frozen=True)
class FamilyRow:
    """One (family, owner)'s figures: bytes summed over its buffers, slots over its accounts."""

    family: str
    owner: Owner
    figures: Figures


@dataclass(frozen=True)
class FamilyHeld:
    """One (family, owner)'s occupied slots and bytes split by holder, summed over its
    accounts (bytes: each account's held slots times its slot_bytes), with the pressure
    counters of those accounts."""

    family: str
    owner: Owner
    slots: Held
    bytes: Held
    evicted_slots_total: int = 0
    evicted_bytes_total: int = 0
    window_evicted_slots_total: int = 0
    window_evicted_bytes_total: int = 0


_held_counts = operator.attrgetter(
    "held_tree_protected",
    "held_tree_evictable",
    "held_request_only",
    "held_unattributed",
    "evicted_slots_total",
    "window_evicted_slots_total",
)
_make_held = record_maker(Held)
_make_family_held = record_maker(FamilyHeld)


def family_held(accounts: Iterable[AccountRow]) -> tuple[FamilyHeld, ...]:
    """The holders per (family, owner) of `accounts`, sorted. Built on every new version of
    a file, so summed as plain columns: per account its four holders' slots and its two
    eviction counters, then each of those times the account's slot_bytes."""
    sums: dict[tuple[str, Owner], tuple[int, ...]] = {}
    for a in accounts:
        counts = _held_counts(a)
        per = a.slot_bytes
        row = (*counts, *[c * per for c in counts])
        key = (a.family, a.owner)
        s = sums.get(key)
        sums[key] = row if s is None else tuple(map(operator.add, s, row))
    out = []
    for (family, owner), row in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
        p, e, r, u, evicted, window, p_b, e_b, r_b, u_b, evicted_b, window_b = row
        out.append(
            _make_family_held(
                family,
                owner,
                _make_held(p, e, r, u),
                _make_held(p_b, e_b, r_b, u_b),
                evicted,
                evicted_b,
                window,
                window_b,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Reconciliation:
    """The ledger held against one device truth (`accounting.reconcile` says what each
    field means). `available` only with a device figure; `unattributed_bytes` is
    device_bytes - ledger_bytes, recomputed, never taken as given."""

    source: str = "unknown"
    basis: str = ""
    available: bool = False
    reason: str = ""
    device_bytes: int | None = None
    ledger_bytes: int | None = None
    unattributed_bytes: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    parts: Mapping[str, int] = field(default_factory=dict)  # accounting.gpu_parts, or {}
    uuid: str = ""  # the GPU's NVML UUID (dcgm-exporter's `UUID` label)
    gpu: str = ""  # the GPU's NVML index (dcgm-exporter's `gpu` label)
    total_bytes: int | None = None  # the device's memory size

    @classmethod
    def of(cls, result: Mapping[str, Any]) -> Reconciliation:
        """A truth reader's result (`accounting.reconcile.result`'s keys; missing ones take
        their defaults)."""
        device, ledger = result.get("device_bytes"), result.get("ledger_bytes")
        return cls(
            source=str(result.get("source", "unknown")),
            basis=result.get("basis", ""),
            available=bool(result.get("available", False)) and device is not None,
            reason=result.get("reason", ""),
            device_bytes=device,
            ledger_bytes=ledger,
            unattributed_bytes=device - ledger
            if device is not None and ledger is not None
            else None,
            detail=dict(result.get("detail") or {}),
            parts=dict(result.get("parts") or {}),
            uuid=str(result.get("uuid") or ""),
            gpu=str(result.get("gpu") or ""),
            total_bytes=result.get("total_bytes"),
        )

    def to_dict(self) -> dict[str, Any]:
        """As `accounting.reconcile.result` writes it."""
        d = dataclasses.asdict(self)
        d["parts"] = dict(self.parts)
        return d


@dataclass(frozen=True)
class Summary:
    """One snapshot without its buffer rows: all a scrape reads."""

    epoch: int  # changes the ledger had applied when the snapshot was taken
    taken_at: float  # Unix time
    labels: Mapping[str, str]  # the ledger's labels as published
    totals: Figures  # the sum of `families`
    families: tuple[FamilyRow, ...]  # sorted by (family, owner)
    accounts: tuple[AccountRow, ...]
    violations: tuple[Violation, ...]
    reconciliation: tuple[Reconciliation, ...]
    tp: TpStatus | None  # present for a pool under tensor parallelism
    holders: tuple[FamilyHeld, ...] = ()  # occupied slots and bytes by holder, per family
    engine: EngineState | None = None  # holders' source and notes, requests (engine_state)


def family_rows(snap: Snapshot) -> tuple[FamilyRow, ...]:
    """The per-(family, owner) rollup of a whole snapshot, sorted."""
    return tuple(
        FamilyRow(family, Owner(owner), Figures.of(figs))
        for (family, owner), figs in sorted(snap.rollup("family", "owner").items())
    )


def summary_of(snap: Snapshot) -> Summary:
    """`snap` without its buffer rows (and without building their dicts). The totals are
    the sum of the per-family rollup."""
    families = family_rows(snap)
    return Summary(
        epoch=snap.epoch,
        taken_at=snap.taken_at,
        labels=dict(snap.labels),
        totals=Figures.sum(f.figures for f in families),
        families=families,
        accounts=snap.accounts,
        violations=snap.violations,
        reconciliation=tuple(Reconciliation.of(r) for r in snap.reconciliation),
        tp=snap.tp,
        holders=family_held(snap.accounts),
        engine=snap.engine,
    )
