"""The relations a snapshot file's figures must satisfy, recomputed rather than believed.

Within the first line (`accounting.snapfile.head.load`): each family's slot figures
are the sum of its accounts' (slots are counted per index space, bytes per buffer),
the totals the sum of the families and within what one source can hold, VMM physical
and mapped bytes whole pages, every relation an account breaks (recomputed by
`accounting.relations.check_account`) is listed, and a family whose sums break a
relation that holds buffer by buffer lists a violation of it. Between the two lines
(`accounting.snapfile.head.buffer_map`): the rollups and violations rebuilt from the
buffer rows equal the first line's. A VMM family's bytes come from its accounts' pages
(`handle_pages_match`), and the engine's requests name only the snapshot's families and
run no more than its slots (`requests_known`). A file that breaks one is refused
("schema") with the relation and the figures that broke it. Relations a genuine writer's
reads could break are violations it must list, recomputed here: the GPU parts and
unattributed bytes against the device's size (`parts_violations_listed`), a listed
request's footprint against its families' tensor bytes (`request_violations_listed`).

Each relation of the first line has two forms here. The one `load` calls
(`families_match_accounts`, `whole_pages`, `violations_complete`, over the account and
family columns `accounting.snapfile.schema` checked) decides the usual case, every
relation holding, with a pass over whole columns and without building a record. When it
cannot, the columns' records go to the same relation checked row by row (`..._by_row`),
which names what broke, so a refusal reads exactly as it did. A pass never accepts what
its `_by_row` form refuses: each is the relation itself (sums per (family, owner), pages,
the relations an account or a family's sums can break), not an approximation of it.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from accounting.buffers import Owner
from accounting.engine_state import EngineState, request_violations
from accounting.figures import FIGURE_NAMES, Figures
from accounting.relations import Violation, check_account
from accounting.rows import AccountRow
from accounting.snapfile.format import MAX_SOURCE_BYTES, MAX_SOURCE_SLOTS, Columns, fail
from accounting.snapfile.summary import (
    FamilyRow,
    Reconciliation,
    Summary,
    account_rows,
    family_columns,
    family_records,
)
from accounting.snapshot import UNATTRIBUTED_WITHIN_TOTAL, parts_violations

Key = tuple[str, Owner]
Table = Mapping[str, list[Any]]
_ZERO = (0, 0, 0)
_gt = operator.gt


# -- the relations over records, row by row: what names a fault ----------------------------------


def _name(key: Key) -> str:
    return f"{key[0]}/{key[1].value}"


def families_match_accounts_by_row(
    rows: Sequence[FamilyRow], accounts: Sequence[AccountRow]
) -> tuple[FamilyRow, ...]:
    """The per-family rows sorted by (family, owner): each listed once, one for every
    account's family, each with the slot figures its accounts sum to."""
    slots: dict[Key, list[int]] = {}
    for a in accounts:
        s = slots.setdefault((a.family, a.owner), [0, 0, 0])
        s[0] += a.occupied_slots
        s[1] += a.capacity_slots
        s[2] += a.occupied_slots * a.slot_bytes
    out: dict[Key, FamilyRow] = {}
    for i, row in enumerate(rows):
        key = (row.family, row.owner)
        if key in out:
            raise fail(f"families[{i}]", f"{_name(key)} listed twice")
        occupied, capacity, occupied_bytes = slots.get(key, (0, 0, 0))
        figs = row.figures
        if (figs.occupied_slots, figs.capacity_slots) != (occupied, capacity):
            raise fail(
                f"families[{i}]",
                f"occupied_slots={figs.occupied_slots} capacity_slots="
                f"{figs.capacity_slots}, but the accounts of {_name(key)} sum to "
                f"{occupied} and {capacity}",
            )
        if figs.occupied_bytes != occupied_bytes:
            # What makes the holders' bytes (held slots x slot_bytes) add up to occupied_bytes.
            raise fail(
                f"families[{i}]",
                f"occupied_bytes={figs.occupied_bytes}, but the accounts of {_name(key)} "
                f"(occupied_slots x slot_bytes) sum to {occupied_bytes}",
            )
        out[key] = row
    missing = sorted(set(slots) - set(out))
    if missing:
        raise fail("families", f"no row for the accounts of {_name(missing[0])}")
    return tuple(out[k] for k in sorted(out))


def totals_match(claimed: dict[str, Any], totals: Figures) -> None:
    """The totals a file claims, each equal to the sum of its families."""
    for figure, total in zip(FIGURE_NAMES, totals.values(), strict=True):
        if claimed.get(figure) != total:
            raise fail(
                "totals", f"{figure}={claimed.get(figure)!r:.60}, but the families sum to {total}"
            )


def within_bounds(totals: Figures) -> None:
    """Every total at most what one source can hold (MAX_SOURCE_BYTES, MAX_SOURCE_SLOTS);
    the families are summed to `totals`, so no family can exceed it either."""
    for figure, value in zip(FIGURE_NAMES, totals.values(), strict=True):
        cap = MAX_SOURCE_SLOTS if figure.endswith("_slots") else MAX_SOURCE_BYTES
        if value > cap:
            raise fail(
                "totals", f"{figure}={value}, over the {cap} one source can hold; not believed"
            )


def whole_pages_by_row(families: Sequence[FamilyRow], accounts: Sequence[AccountRow]) -> None:
    """VMM physical and mapped bytes are whole pages: each buffer holds handle (mapped)
    pages of its account's `page_bytes`, so a family's sums are multiples of the gcd of
    its accounts' page sizes. (Occupied bytes are held to occupied slots times slot bytes
    by `families_match_accounts_by_row`.)"""
    pages: dict[Key, list[int]] = {}
    for a in accounts:
        pages.setdefault((a.family, a.owner), []).append(a.page_bytes)
    for row in families:
        key = (row.family, row.owner)
        sizes = pages.get(key, [])
        if row.owner is not Owner.VMM or not sizes or min(sizes) <= 0:
            continue
        page = math.gcd(*sizes)
        for figure in ("physical_bytes", "mapped_bytes"):
            value = getattr(row.figures, figure)
            if value % page:
                raise fail(
                    f"families {_name(key)}",
                    f"{figure}={value} is not a whole number of pages of {page} bytes "
                    "(its accounts' page_bytes)",
                )


def account_may_break(a: AccountRow) -> bool:
    """Whether `check_account` can find a violation in a checked account row (figures
    already >= 0): only then is it asked."""
    return (
        a.mapped_pages > a.handle_pages
        or a.occupied_slots > a.capacity_slots
        or a.held.total() != a.occupied_slots
    )


# Relations of one buffer that hold for a family's sums whenever they hold for each buffer,
# per owner: (smaller, larger, their places in `Figures.values()`, the relation's name).
_PAIRS = (
    ("tensor_bytes", "reserved_bytes"),
    ("mapped_bytes", "reserved_bytes"),
    ("mapped_bytes", "physical_bytes"),
)
_SUMMED = {
    owner: tuple(
        (lo, hi, FIGURE_NAMES.index(lo), FIGURE_NAMES.index(hi), f"{lo} <= {hi}")
        for lo, hi in (
            *_PAIRS,
            ("occupied_bytes", "mapped_bytes" if owner is Owner.VMM else "tensor_bytes"),
        )
    )
    for owner in Owner
}
# The same pairs as two getters over `Figures.values()`, per owner: a family breaks none of
# them in the usual case, told by one C-level pass (then the loop names what broke).
_SMALLER_LARGER = {
    owner: (
        operator.itemgetter(*(p[2] for p in pairs)),
        operator.itemgetter(*(p[3] for p in pairs)),
    )
    for owner, pairs in _SUMMED.items()
}


def violations_complete_by_row(
    violations: Sequence[Violation],
    accounts: Sequence[AccountRow],
    families: Sequence[FamilyRow],
) -> None:
    """Each account's violations (recomputed) listed, and for a family whose sums break a
    relation, a violation of that relation listed."""
    listed = Counter(violations)
    for a in accounts:
        if not account_may_break(a):
            continue
        for v in check_account(a):
            if listed[v] <= 0:
                raise fail("violations", f"account {a.key!r:.60} breaks {v.relation}; not listed")
            listed[v] -= 1
    relations = {v.relation for v in violations}
    for row in families:
        figs = row.figures.values()
        smaller, larger = _SMALLER_LARGER[row.owner]
        if not any(map(operator.gt, smaller(figs), larger(figs))):
            continue
        for lo, hi, lo_at, hi_at, relation in _SUMMED[row.owner]:
            small, large = figs[lo_at], figs[hi_at]
            if small > large and relation not in relations:
                raise fail(
                    "violations",
                    f"family {row.family}/{row.owner.value} sums to {lo}={small} > "
                    f"{hi}={large}; no violation of {relation} listed",
                )


def parts_violations_listed(
    violations: Sequence[Violation], reconciliation: Sequence[Reconciliation]
) -> None:
    """Each truth result's GPU parts held against its NVML figures and the device's size
    again, and its unattributed bytes against that size (`accounting.snapshot.
    parts_violations`): a broken relation must be listed."""
    listed = set(violations)
    for r in reconciliation:
        if not r.parts and r.total_bytes is None:
            continue
        for v in parts_violations(r.to_dict()):
            if v not in listed:
                what = (
                    "its unattributed bytes break"
                    if v.relation == UNATTRIBUTED_WITHIN_TOTAL
                    else "the GPU parts break"
                )
                raise fail("violations", f"{v.subject}: {what} {v.relation}; not listed")


def rows_agree(rows: Summary, head: Summary) -> None:
    """The summary rebuilt from the buffer rows against the first line's."""
    by_key = {(r.family, r.owner): r for r in head.families}
    for r in rows.families:
        h = by_key.pop((r.family, r.owner), None)
        where = f"families {r.family}/{r.owner.value}"
        if h is None:
            raise fail(where, "in the buffer rows, not in the first line")
        for name, got, said in zip(
            FIGURE_NAMES, r.figures.values(), h.figures.values(), strict=True
        ):
            if got != said:
                raise fail(where, f"{name}: the rows sum to {got}, the first line says {said}")
    if by_key:
        raise fail(f"families {_name(min(by_key))}", "in the first line, not in the buffer rows")
    listed, found = Counter(head.violations), Counter(rows.violations)
    extra, missing = found - listed, listed - found
    if extra or missing:
        v = next(iter(extra or missing))
        where = (
            "found in the buffer rows, not listed in the first line"
            if extra
            else "listed in the first line, not found in the buffer rows"
        )
        raise fail("violations", f"{v.subject}: {v.relation} {where}")


# -- the same relations over the first line's columns (what `load` calls) ---------------------
def keys_unique(accounts: Table) -> None:
    """Each account key listed once."""
    keys = accounts["key"]
    if len(set(keys)) < len(keys):
        key = Counter(keys).most_common(1)[0][0]
        raise fail("accounts", f"key {key!r:.60} listed twice")


def families_match_accounts(families: Table, accounts: Table) -> Columns:
    """`families_match_accounts_by_row` over columns: the family columns sorted by (family,
    owner), each (family, owner) listed once, one for every account's, each with the slot
    figures (occupied, capacity, occupied slots x slot_bytes) its accounts sum to."""
    a = accounts
    slots: dict[tuple[str, str], tuple[int, int, int]] = {}
    occupied_bytes = map(operator.mul, a["occupied_slots"], a["slot_bytes"])
    for key, sums in zip(
        zip(a["family"], a["owner"], strict=True),
        zip(a["occupied_slots"], a["capacity_slots"], occupied_bytes, strict=True),
        strict=True,
    ):
        s = slots.get(key)
        slots[key] = sums if s is None else (s[0] + sums[0], s[1] + sums[1], s[2] + sums[2])
    keys = list(zip(families["family"], families["owner"], strict=True))
    claimed = dict(
        zip(
            keys,
            zip(
                families["occupied_slots"],
                families["capacity_slots"],
                families["occupied_bytes"],
                strict=True,
            ),
            strict=True,
        )
    )
    if len(claimed) == len(keys) and claimed == {**dict.fromkeys(claimed, _ZERO), **slots}:
        if keys == sorted(keys):
            return dict(families)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        return {name: [column[i] for i in order] for name, column in families.items()}
    rows = families_match_accounts_by_row(family_records(families), account_rows(accounts))
    return family_columns(rows)  # (refuses what the pass above does not take)


def totals(families: Table) -> Figures:
    """The sum of the families, figure by figure."""
    return Figures(*(sum(families[name]) for name in FIGURE_NAMES))


def whole_pages(families: Table, accounts: Table) -> None:
    """`whole_pages_by_row` over columns: a VMM family's physical and mapped bytes are
    multiples of the gcd of its accounts' page_bytes."""
    pages: dict[tuple[str, str], list[int]] = {}
    for key, page in zip(
        zip(accounts["family"], accounts["owner"], strict=True), accounts["page_bytes"], strict=True
    ):
        pages.setdefault(key, []).append(page)
    f = families
    for family, owner, physical, mapped in zip(
        f["family"], f["owner"], f["physical_bytes"], f["mapped_bytes"], strict=True
    ):
        sizes = pages.get((family, owner))
        if owner != "vmm" or not sizes or min(sizes) <= 0:
            continue
        page = math.gcd(*sizes)
        if physical % page or mapped % page:
            whole_pages_by_row(family_records(families), account_rows(accounts))


def _may_break(a: Table) -> bool:
    """Whether any account can break a relation (`account_may_break`, per column)."""
    held = zip(
        a["held_tree_protected"],
        a["held_tree_evictable"],
        a["held_request_only"],
        a["held_unattributed"],
        strict=True,
    )
    return (
        any(map(_gt, a["mapped_pages"], a["handle_pages"]))
        or any(map(_gt, a["occupied_slots"], a["capacity_slots"]))
        or list(map(sum, held)) != a["occupied_slots"]
    )


def _sums_break(f: Table) -> bool:
    """Whether any family's sums break a relation that holds buffer by buffer
    (`_SUMMED`: tensor <= reserved, mapped <= reserved, mapped <= physical, and
    occupied <= mapped for a VMM family, <= tensor for another)."""
    tensor, reserved, mapped = f["tensor_bytes"], f["reserved_bytes"], f["mapped_bytes"]
    limit = map(_vmm_or, f["owner"], mapped, tensor)
    return (
        any(map(_gt, tensor, reserved))
        or any(map(_gt, mapped, reserved))
        or any(map(_gt, mapped, f["physical_bytes"]))
        or any(map(_gt, f["occupied_bytes"], limit))
    )


def _vmm_or(owner: str, vmm: int, other: int) -> int:
    return vmm if owner == "vmm" else other


def violations_complete(violations: Sequence[Violation], accounts: Table, families: Table) -> None:
    """`violations_complete_by_row` over columns: every relation an account breaks, and every
    relation a family's sums break, listed. Asked of the records only when one may be broken."""
    if _may_break(accounts) or _sums_break(families):
        violations_complete_by_row(violations, account_rows(accounts), family_records(families))


# -- a VMM family's bytes against its accounts' pages ----------------------------------------
def handle_pages_match(families: Table, accounts: Table) -> None:
    """A VMM family's physical and mapped bytes come from its accounts' pages: each of an
    account's buffers (at least one, all of its family) holds `handle_pages` pages of its
    `page_bytes` physically and `mapped_pages` of them mapped (`accounting.ledger.
    buffer_rows`), so the family holds n_a times each per account. Hence its bytes are at
    least the accounts' pages once (none when no account holds a page: 6 MiB physical next
    to handle_pages 0 is refused), and, with one account, exactly n times its pages, the
    same n for physical and mapped bytes."""
    held: dict[str, list[tuple[int, int]]] = {}
    for family, owner, page, handle, mapped in zip(
        accounts["family"],
        accounts["owner"],
        accounts["page_bytes"],
        accounts["handle_pages"],
        accounts["mapped_pages"],
        strict=True,
    ):
        if owner == "vmm":
            held.setdefault(family, []).append((handle * page, mapped * page))
    f = families
    for family, owner, physical, mapped in zip(
        f["family"], f["owner"], f["physical_bytes"], f["mapped_bytes"], strict=True
    ):
        if owner != "vmm":
            continue
        pages = held.get(family, [])
        handle_bytes = sum(h for h, _ in pages)
        mapped_bytes = sum(m for _, m in pages)
        where = f"families {family}/vmm"
        if physical < handle_bytes or mapped < mapped_bytes:
            raise fail(
                where,
                f"physical_bytes={physical} mapped_bytes={mapped}, less than its accounts' "
                f"handle and mapped pages hold once ({handle_bytes} and {mapped_bytes} bytes)",
            )
        if (physical and not handle_bytes) or (mapped and not mapped_bytes):
            raise fail(
                where,
                f"physical_bytes={physical} mapped_bytes={mapped}, but its accounts hold "
                f"{handle_bytes} bytes of handle pages and {mapped_bytes} mapped",
            )
        if len(pages) == 1 and handle_bytes:
            n, rest = divmod(physical, handle_bytes)
            if rest or mapped != n * mapped_bytes:
                raise fail(
                    where,
                    f"physical_bytes={physical} mapped_bytes={mapped}: not the same number of "
                    f"buffers times its account's {handle_bytes} bytes of handle pages and "
                    f"{mapped_bytes} mapped",
                )


# -- the engine's requests against the families ----------------------------------------------
def requests_known(engine: EngineState | None, families: Table, totals: Figures) -> None:
    """The engine's figures within the snapshot's: every family a request names is one of
    the snapshot's families (the footprints are read for the ledger's own families), and
    no more requests running than the slots of every family together (each running request
    holds at least a request slot or a token's)."""
    if engine is None:
        return
    if engine.running_requests > totals.capacity_slots:
        raise fail(
            "engine",
            f"running_requests={engine.running_requests}, more than the "
            f"{totals.capacity_slots} slots of every family together",
        )
    names = set(families["family"])
    for i, r in enumerate(engine.requests):
        unknown = sorted(set(r.bytes_by_family) - names)
        if unknown:
            raise fail(
                f"engine.requests[{i}]",
                f"bytes_by_family names {unknown[0]!r:.60}, not a family of this snapshot",
            )


def request_violations_listed(
    violations: Sequence[Violation], engine: EngineState | None, families: Table
) -> None:
    """Every listed request claiming more than its families hold
    (`accounting.engine_state.request_violations`, recomputed) is a listed violation."""
    if engine is None or not engine.requests:
        return
    occupied: dict[str, int] = {}
    for family, nbytes in zip(families["family"], families["tensor_bytes"], strict=True):
        occupied[family] = occupied.get(family, 0) + nbytes
    listed = Counter(violations)
    for v in request_violations(engine, occupied):
        if listed[v] <= 0:
            raise fail("violations", f"{v.subject:.80}: breaks {v.relation}; not listed")
        listed[v] -= 1
