"""One consistent view of the ledger: its rows (`accounting.rows`), rollups, relation checks.

A snapshot is immutable, built at one moment under the ledger's lock and tagged
with the ledger's epoch (the number of events it had applied). Rollups are
computed from its rows; serialising and parsing it round-trips exactly, which is
how it travels from an engine process to the exporter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accounting.buffers import Owner
from accounting.engine_state import EngineState, request_violations
from accounting.figures import FIGURE_NAMES, FIGURES
from accounting.gpu_parts import check_parts
from accounting.relations import Violation, check_account, check_buffer
from accounting.request_slots import RequestSlots
from accounting.rows import AccountRow, BufferRow
from accounting.tp_status import TpStatus

# 2: account rows carry slot_bytes, the holders (held_*) and the eviction counters, and a
# snapshot may carry the engine's state (accounting.engine_state); a reader of 1 would drop
# them silently, so the version says so.
SCHEMA_VERSION = 2
TRUTH_SUBJECT = "truth "  # subject of a truth result's violations: "truth nvml"


UNATTRIBUTED_WITHIN_TOTAL = "|unattributed_bytes| <= device total"


def parts_violations(r: Mapping[str, Any]) -> list[Violation]:
    """The relations of a truth result: its GPU parts' (`accounting.gpu_parts.check_parts`,
    none without parts), and, where the device's size is known, its unattributed bytes
    (device_bytes - ledger_bytes, recomputed) at most that size either way: a device
    cannot hold, or miss, more than it has."""
    subject = f"{TRUTH_SUBJECT}{r.get('source', 'unknown')}"
    total = r.get("total_bytes")
    out: list[Violation] = []
    device, ledger = r.get("device_bytes"), r.get("ledger_bytes")
    if (
        total is not None
        and device is not None
        and ledger is not None
        and abs(device - ledger) > total
    ):
        out.append(
            Violation(
                subject,
                UNATTRIBUTED_WITHIN_TOTAL,
                f"unattributed_bytes={device - ledger}, total_bytes={total}",
            )
        )
    parts = r.get("parts") or {}
    if not parts:
        return out
    detail = r.get("detail") or {}
    return out + check_parts(
        parts,
        device_used=detail.get("used_bytes"),
        process_used=detail.get("process_used_bytes"),
        basis=str(r.get("basis") or ""),
        subject=subject,
        total_bytes=total,
    )


ROLLUP_KEYS = ("family", "pool", "owner")


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    taken_at: float
    labels: dict[str, str]
    accounts: tuple[AccountRow, ...]
    buffers: tuple[BufferRow, ...]
    violations: tuple[Violation, ...]
    reconciliation: tuple[dict[str, Any], ...] = ()
    tp: TpStatus | None = None  # this rank's TP control traffic (allocator.tp), None without TP
    engine: EngineState | None = None  # holders' source, notes, requests (accounting.engine_state)
    # running requests' slots per family, for an engine whose accounts carry no bytes
    # (accounting.request_slots); written only when present
    request_slots: RequestSlots | None = None
    _rollups: dict[tuple[str, ...], dict[tuple[str, ...], dict[str, int]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def build(
        cls,
        *,
        epoch: int,
        taken_at: float,
        labels: dict[str, str],
        accounts: Sequence[AccountRow],
        buffers: Sequence[BufferRow],
        tp: TpStatus | None = None,
        engine: EngineState | None = None,
        request_slots: RequestSlots | None = None,
    ) -> Snapshot:
        violations = [v for b in buffers for v in check_buffer(b)]
        violations += [v for a in accounts for v in check_account(a)]
        if engine is not None and engine.requests:
            occupied: dict[str, int] = {}
            for b in buffers:
                occupied[b.spec.family] = occupied.get(b.spec.family, 0) + b.spec.tensor_bytes
            violations += request_violations(engine, occupied)
        return cls(
            epoch=epoch,
            taken_at=taken_at,
            labels=labels,
            accounts=tuple(accounts),
            buffers=tuple(buffers),
            violations=tuple(violations),
            tp=tp,
            engine=engine,
            request_slots=request_slots,
        )

    def with_reconciliation(self, results: Iterable[dict[str, Any]]) -> Snapshot:
        """The snapshot with these truth results; the GPU parts of each are held against
        its NVML figures (`accounting.gpu_parts.check_parts`), a broken relation listed
        among the violations under the subject `truth <source>`."""
        results = tuple(results)
        kept = [v for v in self.violations if not v.subject.startswith(TRUTH_SUBJECT)]
        for r in results:
            kept += parts_violations(r)
        return dataclasses.replace(
            self, reconciliation=results, violations=tuple(kept), _rollups={}
        )

    # -- rollups: views over rows, never counters of their own ------------------
    def rollup(self, *by: str) -> dict[tuple[str, ...], dict[str, int]]:
        """Figures summed per key: bytes over buffers, slots over accounts.

        `by` names any of "family", "pool", "owner"; no names gives the total under key ().
        """
        for name in by:
            if name not in ROLLUP_KEYS:
                raise ValueError(f"rollup: unknown key {name!r}, expected one of {ROLLUP_KEYS}")
        cached = self._rollups.get(by)
        if cached is not None:
            return {k: dict(v) for k, v in cached.items()}  # copies: the snapshot stays as taken
        out: dict[tuple[str, ...], dict[str, int]] = {}
        slot_figures = [f.name for f in FIGURES if f.per_account]
        byte_figures = [f.name for f in FIGURES if not f.per_account]
        for row in self.buffers:
            key = tuple(_key_value(row.spec, n) for n in by)
            sums = out.setdefault(key, dict.fromkeys(FIGURE_NAMES, 0))
            figs = row.figures()
            for name in byte_figures:
                sums[name] += figs[name]
        for acc in self.accounts:
            key = tuple(_key_value(acc, n) for n in by)
            sums = out.setdefault(key, dict.fromkeys(FIGURE_NAMES, 0))
            sums["occupied_slots"] += acc.occupied_slots
            sums["capacity_slots"] += acc.capacity_slots
        assert set(slot_figures) == {"occupied_slots", "capacity_slots"}
        self._rollups[by] = out
        return {k: dict(v) for k, v in out.items()}

    def total(self, figure_name: str) -> int:
        return self.rollup().get((), dict.fromkeys(FIGURE_NAMES, 0))[figure_name]

    # -- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema": SCHEMA_VERSION,
            "epoch": self.epoch,
            "taken_at": self.taken_at,
            "labels": dict(self.labels),
            "totals": self.rollup().get((), dict.fromkeys(FIGURE_NAMES, 0)),
            "families": [
                {"family": fam, "owner": own, **figs}
                for (fam, own), figs in sorted(self.rollup("family", "owner").items())
            ],
            "accounts": [a.to_dict() for a in self.accounts],
            "buffers": [b.to_dict() for b in self.buffers],
            "violations": [v.to_dict() for v in self.violations],
            "reconciliation": [dict(r) for r in self.reconciliation],
            "tp": self.tp.to_dict() if self.tp is not None else None,
            "engine": self.engine.to_dict() if self.engine is not None else None,
        }
        if self.request_slots is not None:
            out["request_slots"] = self.request_slots.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Snapshot:
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"snapshot schema={d.get('schema')!r}, expected {SCHEMA_VERSION}")
        return cls(
            epoch=d["epoch"],
            taken_at=d["taken_at"],
            labels=dict(d["labels"]),
            accounts=tuple(AccountRow.from_dict(a) for a in d["accounts"]),
            buffers=tuple(BufferRow.from_dict(b) for b in d["buffers"]),
            violations=tuple(Violation.from_dict(v) for v in d["violations"]),
            reconciliation=tuple(d.get("reconciliation", ())),
            tp=TpStatus.from_dict(d["tp"]) if d.get("tp") is not None else None,
            engine=EngineState.from_dict(d["engine"]) if d.get("engine") is not None else None,
            request_slots=(
                RequestSlots.from_dict(d["request_slots"])
                if d.get("request_slots") is not None
                else None
            ),
        )


def _key_value(obj: Any, name: str) -> str:
    value = getattr(obj, name)
    return value.value if isinstance(value, Owner) else str(value)
