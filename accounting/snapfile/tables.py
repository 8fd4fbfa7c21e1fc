"""The first line's account and family columns, checked: every field's type and range.

The same checks as a row's (`accounting.snapfile.schema`): an account has exactly
AccountRow's fields (integers in [0, MAX_INT], short strings, an owner of `Owner`,
finite non-negative seconds, `len(MAP_SECONDS_BUCKETS) + 1` bucket counts), a family
row its name, owner and every figure (integers in [0, MAX_INT]). The common case,
every value well formed, is told by a few C-level passes over whole columns; a table
that fails them is checked row by row by the row checkers (`schema.account_fields`,
`schema.family_row`), which name the first fault, so a refusal reads as it did for
rows: "accounts[3]: mapped_pages=-1, expected an integer >= 0". A table is returned
as checked columns, owners as their values (`accounting.snapfile.summary`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from accounting.figures import FIGURE_NAMES
from accounting.snapfile import schema
from accounting.snapfile.columns import Columns, columns_of, rows_of, table_of
from accounting.snapfile.schema import MAX_FAMILIES, MAX_ROWS, OWNERS, plain_ints, plain_strs
from accounting.snapfile.summary import ACCOUNT_FIELDS, FAMILY_FIELDS, family_columns

_chain = itertools.chain.from_iterable
_ACCOUNT_INTS = schema.ACCOUNT_INTS
_BUCKETS = schema.BUCKETS
FLOAT = {float}
LIST = {list}


def _plain_accounts(t: Columns) -> bool:
    """Every account value of its type and range, told column by column with C-level
    builtins. False to take the row-by-row path."""
    if not t["key"]:
        return True
    buckets = t["map_bucket_counts"]
    seconds = t["map_seconds_total"] + t["unmap_seconds_total"]
    try:
        owners = set(t["owner"])
    except TypeError:  # unhashable
        return False
    return (
        plain_ints(list(_chain(map(t.__getitem__, _ACCOUNT_INTS))))
        and set(map(type, buckets)) == LIST
        and set(map(len, buckets)) == {_BUCKETS}
        and plain_ints(list(_chain(buckets)))
        and plain_strs(t["key"] + t["family"] + t["pool"])
        and owners <= OWNERS
        and set(map(type, seconds)) == FLOAT
        and all(map(math.isfinite, seconds))
        and min(seconds) >= 0
    )


def account_table(d: Any) -> Columns:
    """The account columns, checked: exactly AccountRow's fields (seconds as floats)."""
    table = table_of(d, "accounts", ACCOUNT_FIELDS, MAX_ROWS)
    if _plain_accounts(table):
        return table
    rows = rows_of(table, ACCOUNT_FIELDS)
    return columns_of((schema.account_fields(row, i) for i, row in enumerate(rows)), ACCOUNT_FIELDS)


def _plain_families(t: Columns) -> bool:
    """Every family value of its type and range (C-level passes); False to take the
    row-by-row path."""
    if not t["family"]:
        return True
    try:
        owners = set(t["owner"])
    except TypeError:  # unhashable
        return False
    return (
        plain_strs(t["family"])
        and owners <= OWNERS
        and plain_ints(list(_chain(map(t.__getitem__, FIGURE_NAMES))))
    )


def family_table(d: Any) -> Columns:
    """The per-family columns as listed, checked (their sums: `accounting.snapfile.relations`)."""
    table = table_of(d, "families", FAMILY_FIELDS, MAX_FAMILIES)
    if _plain_families(table):
        return table
    rows = rows_of(table, FAMILY_FIELDS)
    return family_columns(schema.family_row(row, i) for i, row in enumerate(rows))
