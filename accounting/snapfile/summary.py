"""What a scrape reads of one snapshot: everything but the buffer rows, typed.

A `Summary` is built once per snapshot: from a published file's first line when
it is checked (`accounting.snapfile.head.load`), or from a whole `Snapshot` by
`summary_of` (a ledger read in-process, or a file's buffer rows when someone asks
for its buffer map and they are held against the first line). The collector and
the debug view read its fields by name; nothing downstream reads the JSON.

The rows reuse accounting's own records (`AccountRow`, `Violation`, `TpStatus`,
`Figures`); what only a summary has is declared here: a family's rollup row and a
reconciliation result. The accounts, the family rows and the holders are held as
columns (one list per field: `ACCOUNT_FIELDS` and `FAMILY_FIELDS`, from
`accounting.snapfile.format`, and `HOLDER_FIELDS`), as a file's first line carries them
since `kvledger_publish` 2; a republished rank's series are written from those, and the
records (`Summary.accounts`, `.families`, `.holders`) are built from them the first time
someone reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accounting.buffers import Owner
from accounting.engine_state import EngineState
from accounting.figures import FIGURE_NAMES, HOLDER_NAMES, Figures, Held
from accounting.records import record_maker
from accounting.relations import Violation
from accounting.request_slots import RequestSlots
from accounting.rows import AccountRow
from accounting.snapfile.format import ACCOUNT_FIELDS, Columns
from accounting.snapshot import Snapshot
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


# The columns of a summary's parts: an account's and a family row's as the first line
# writes them (`accounting.snapfile.format`), a holder row's as FamilyHeld's with each split
# by holder.
_HELD_COUNTS = (*(f"held_{h}" for h in HOLDER_NAMES), "evicted_slots_total")
_HELD_COUNTS += ("window_evicted_slots_total",)
HOLDER_FIELDS = (
    "family",
    "owner",
    *(f"slots_{h}" for h in HOLDER_NAMES),
    *(f"bytes_{h}" for h in HOLDER_NAMES),
    "evicted_slots_total",
    "evicted_bytes_total",
    "window_evicted_slots_total",
    "window_evicted_bytes_total",
)
_OWNER_OF = {o.value: o for o in Owner}
_make_held = record_maker(Held)
_make_family_held = record_maker(FamilyHeld)
_make_account = record_maker(AccountRow)
_make_figures = record_maker(Figures)
_make_family = record_maker(FamilyRow)
_OWNER_AT = ACCOUNT_FIELDS.index("owner")
_BUCKETS_AT = ACCOUNT_FIELDS.index("map_bucket_counts")


def holder_columns(accounts: Mapping[str, Sequence[Any]]) -> Columns:
    """The holders per (family, owner) of checked account columns, sorted: per account its
    four holders' slots and its two eviction counters, then each of those times the
    account's slot_bytes, summed over the accounts of a (family, owner)."""
    per = accounts["slot_bytes"]
    counts = [accounts[name] for name in _HELD_COUNTS]
    nbytes = [list(map(operator.mul, c, per)) for c in counts]
    sums: dict[tuple[str, str], tuple[int, ...]] = {}
    for key, row in zip(
        zip(accounts["family"], accounts["owner"], strict=True),
        zip(*counts, *nbytes, strict=True),
        strict=True,
    ):
        s = sums.get(key)
        sums[key] = row if s is None else tuple(map(operator.add, s, row))
    keys = sorted(sums)
    values = list(zip(*map(sums.__getitem__, keys), strict=True)) or [()] * 12
    p, e, r, u, evicted, window, p_b, e_b, r_b, u_b, evicted_b, window_b = map(list, values)
    return dict(
        zip(
            HOLDER_FIELDS,
            (
                [k[0] for k in keys],
                [k[1] for k in keys],
                p,
                e,
                r,
                u,
                p_b,
                e_b,
                r_b,
                u_b,
                evicted,
                evicted_b,
                window,
                window_b,
            ),
            strict=True,
        )
    )


def family_held(accounts: Iterable[AccountRow]) -> tuple[FamilyHeld, ...]:
    """The holders per (family, owner) of `accounts`, sorted."""
    return holder_rows(holder_columns(account_columns(accounts)))


def holder_rows(c: Mapping[str, Sequence[Any]]) -> tuple[FamilyHeld, ...]:
    """The records of holder columns (`holder_columns`)."""
    p, e, r, u, p_b, e_b, r_b, u_b = (c[name] for name in HOLDER_FIELDS[2:10])
    return tuple(
        _make_family_held(
            family, _OWNER_OF[owner], _make_held(*slots), _make_held(*nbytes), *evicted
        )
        for family, owner, slots, nbytes, evicted in zip(
            c["family"],
            c["owner"],
            zip(p, e, r, u, strict=True),
            zip(p_b, e_b, r_b, u_b, strict=True),
            zip(*(c[name] for name in HOLDER_FIELDS[10:]), strict=True),
            strict=True,
        )
    )


def account_columns(accounts: Iterable[AccountRow]) -> Columns:
    """Account records as columns (owners as values, bucket counts as lists)."""
    rows = list(accounts)
    out = {name: [getattr(a, name) for a in rows] for name in ACCOUNT_FIELDS}
    out["owner"] = [o.value for o in out["owner"]]
    out["map_bucket_counts"] = [list(b) for b in out["map_bucket_counts"]]
    return out


def account_rows(c: Mapping[str, Sequence[Any]]) -> tuple[AccountRow, ...]:
    """The records of checked account columns (exactly AccountRow's fields, each of its type)."""
    columns: list[Iterable[Any]] = [c[name] for name in ACCOUNT_FIELDS]
    columns[_OWNER_AT] = map(_OWNER_OF.__getitem__, c["owner"])
    columns[_BUCKETS_AT] = map(tuple, c["map_bucket_counts"])
    return tuple(itertools.starmap(_make_account, zip(*columns, strict=True)))


def family_columns(rows: Iterable[FamilyRow]) -> Columns:
    """Family records as columns (owners as values)."""
    rows = list(rows)
    out = {"family": [r.family for r in rows], "owner": [r.owner.value for r in rows]}
    figures = list(zip(*(r.figures.values() for r in rows), strict=True)) or [()] * len(
        FIGURE_NAMES
    )
    out.update(zip(FIGURE_NAMES, map(list, figures), strict=True))
    return out


def family_records(c: Mapping[str, Sequence[Any]]) -> tuple[FamilyRow, ...]:
    """The records of checked family columns."""
    return tuple(
        _make_family(family, _OWNER_OF[owner], _make_figures(*figures))
        for family, owner, figures in zip(
            c["family"],
            c["owner"],
            zip(*(c[name] for name in FIGURE_NAMES), strict=True),
            strict=True,
        )
    )


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
    """One snapshot without its buffer rows: all a scrape reads.

    The accounts, the family rows and the holders are held as columns (a scrape writes
    its series from those); their records (`accounts`, `families`, `holders`) are built
    the first time someone reads them (/debug/kv, a buffer map, a vLLM view), once."""

    epoch: int  # changes the ledger had applied when the snapshot was taken
    taken_at: float  # Unix time
    labels: Mapping[str, str]  # the ledger's labels as published
    totals: Figures  # the sum of the families
    family_columns: Mapping[str, list[Any]]  # FAMILY_FIELDS, sorted by (family, owner)
    account_columns: Mapping[str, list[Any]]  # ACCOUNT_FIELDS, as listed
    violations: tuple[Violation, ...]
    reconciliation: tuple[Reconciliation, ...]
    tp: TpStatus | None  # present for a pool under tensor parallelism
    engine: EngineState | None = None  # holders' source and notes, requests (engine_state)
    request_slots: RequestSlots | None = None  # running requests' slots (request_slots)

    @functools.cached_property
    def holder_columns(self) -> Columns:
        """HOLDER_FIELDS: occupied slots and bytes by holder per (family, owner), sorted."""
        return holder_columns(self.account_columns)

    @functools.cached_property
    def accounts(self) -> tuple[AccountRow, ...]:
        return account_rows(self.account_columns)

    @functools.cached_property
    def families(self) -> tuple[FamilyRow, ...]:
        """Sorted by (family, owner)."""
        return family_records(self.family_columns)

    @functools.cached_property
    def holders(self) -> tuple[FamilyHeld, ...]:
        """Occupied slots and bytes by holder, per family, sorted."""
        return holder_rows(self.holder_columns)


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
    s = Summary(
        epoch=snap.epoch,
        taken_at=snap.taken_at,
        labels=dict(snap.labels),
        totals=Figures.sum(f.figures for f in families),
        family_columns=family_columns(families),
        account_columns=account_columns(snap.accounts),
        violations=snap.violations,
        reconciliation=tuple(Reconciliation.of(r) for r in snap.reconciliation),
        tp=snap.tp,
        engine=snap.engine,
        request_slots=snap.request_slots,
    )
    s.__dict__["accounts"] = snap.accounts  # the records at hand (cached_property's place)
    s.__dict__["families"] = families
    return s
