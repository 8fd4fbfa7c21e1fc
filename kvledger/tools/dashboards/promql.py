"""The metric names a PromQL expression reads, found by a small lexer (no full parser).

String literals, label matchers (`{...}`), range and subquery brackets (`[...]`)
and the label lists of `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`
are removed first; what remains of the identifiers, less keywords, function names
(followed by `(`) and numbers, are metric names.
"""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "atan2",
        "inf",
        "nan",
    }
)


def metric_names(expr: str) -> frozenset[str]:
    """Every metric name `expr` selects, e.g. {"kvledger_up"} for `sum(kvledger_up{a="b"})`."""
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError(f"metric_names: expr={expr!r}, expected a non-empty PromQL string")
    text = _STRING.sub('""', expr)
    text = _BRACES.sub("", text)
    text = _BRACKETS.sub("", text)
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", word):  # a duration outside brackets, e.g. offset 5m
            continue
        names.add(word)
    return frozenset(names)


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")


def label_values(definition: str) -> tuple[str, str]:
    """(series selector, label) of a Grafana `label_values(selector, label)` variable query."""
    m = _LABEL_VALUES.match(definition)
    if not m:
        raise ValueError(
            f"variable query {definition!r}: expected label_values(<series selector>, <label>)"
        )
    return m.group(1), m.group(2)
