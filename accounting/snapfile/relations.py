"""The first line's relations (`accounting.snapfile.checks`), told over its columns.

Each check here is `checks`' relation for account and family columns
(`accounting.snapfile.tables`): a pass over whole columns decides the usual case, every
relation holding, without building a record; when it cannot, the columns' records go
to `checks`' own function, which names what broke, so a refusal reads exactly as it
did. A pass here never accepts what `checks` refuses: each is the relation itself
(sums per (family, owner), pages, the relations an account or a family's sums can
break), not an approximation of it.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from accounting.figures import FIGURE_NAMES, Figures
from accounting.relations import Violation
from accounting.snapfile import checks
from accounting.snapfile.columns import Columns
from accounting.snapfile.refusal import fail
from accounting.snapfile.summary import account_rows, family_columns, family_records

Table = Mapping[str, list[Any]]
_ZERO = (0, 0, 0)
_gt = operator.gt


def keys_unique(accounts: Table) -> None:
    """Each account key listed once."""
    keys = accounts["key"]
    if len(set(keys)) < len(keys):
        key = Counter(keys).most_common(1)[0][0]
        raise fail("accounts", f"key {key!r:.60} listed twice")


def families_match_accounts(families: Table, accounts: Table) -> Columns:
    """`checks.families_match_accounts`: the family columns sorted by (family, owner), each
    (family, owner) listed once, one for every account's, each with the slot figures
    (occupied, capacity, occupied slots x slot_bytes) its accounts sum to."""
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
    rows = checks.families_match_accounts(family_records(families), account_rows(accounts))
    return family_columns(rows)  # (checks refuses what the pass above does not take)


def totals(families: Table) -> Figures:
    """The sum of the families, figure by figure."""
    return Figures(*(sum(families[name]) for name in FIGURE_NAMES))


def whole_pages(families: Table, accounts: Table) -> None:
    """`checks.whole_pages`: a VMM family's physical and mapped bytes are multiples of the
    gcd of its accounts' page_bytes."""
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
            checks.whole_pages(family_records(families), account_rows(accounts))


def _may_break(a: Table) -> bool:
    """Whether any account can break a relation (`checks.account_may_break`, per column)."""
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
    (`checks._SUMMED`: tensor <= reserved, mapped <= reserved, mapped <= physical, and
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
    """`checks.violations_complete`: every relation an account breaks, and every relation a
    family's sums break, listed. Asked of the records only when one may be broken."""
    if _may_break(accounts) or _sums_break(families):
        checks.violations_complete(violations, account_rows(accounts), family_records(families))
