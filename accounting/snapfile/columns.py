"""Rows written as columns: the first line's accounts and families, one list per field.

Since `kvledger_publish` 2 a file's first line carries its account rows and its
per-family rows as columns: an object holding one list per field, every list as long
as there are rows, the field names written once (`{"key": [...], "family": [...], ...}`)
instead of once a row. The first line of a DeepSeek-V4 rank is then ~2.8 KB instead
of ~6.2 KB and parses in about 60 % of the time, and a reader checks a field's values
a whole column at a time.

`columns_of` writes rows as columns (the publisher), `rows_of` reads them back as
rows (a process reading its own files); `table_of` is the exporter's first check of
such an object: an object, every named column present and a list, all of one length,
at most `limit` rows. Keys it does not name are dropped, as a row's extra keys were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from accounting.snapfile.refusal import fail

Columns = dict[str, list[Any]]


def columns_of(rows: Iterable[Mapping[str, Any]], names: Sequence[str]) -> Columns:
    """`rows` (dicts holding every one of `names`) as one list per name."""
    rows = list(rows)
    return {name: [row[name] for row in rows] for name in names}


def rows_of(columns: Mapping[str, Sequence[Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of trusted `columns` (every name present, all of one length)."""
    return [
        dict(zip(names, values, strict=True))
        for values in zip(*(columns[n] for n in names), strict=True)
    ]


def table_of(d: Any, where: str, names: Sequence[str], limit: int) -> Columns:
    """`d` checked as columns: an object with a list for each of `names`, all of one
    length, at most `limit`; "schema" refusals naming `where` and the column."""
    if not isinstance(d, dict):
        raise fail(where, f"expected an object of columns, got {type(d).__name__}")
    try:
        table = {name: d[name] for name in names}
    except KeyError:
        missing = next(n for n in names if n not in d)
        raise fail(where, f"missing column {missing!r}") from None
    columns = table.values()
    if set(map(type, columns)) != {list}:
        name = next(n for n, c in table.items() if type(c) is not list)
        raise fail(where, f"{name}: expected a list, got {type(table[name]).__name__}")
    lengths = set(map(len, columns))
    if len(lengths) > 1:
        first = len(table[names[0]])
        name = next(n for n, c in table.items() if len(c) != first)
        raise fail(
            where,
            f"columns of different lengths: {names[0]} has {first}, {name} {len(table[name])}",
        )
    n = lengths.pop() if lengths else 0
    if n > limit:
        raise fail(where, f"{n} entries, expected at most {limit}")
    return table
