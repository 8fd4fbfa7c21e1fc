"""Rendering `/metrics`: the format follows the Accept header, the names never do.

Two traps in prometheus-client 0.2x's writers, both seen here with 0.26:
- its negotiation (`choose_encoder`) honours an `escaping=` parameter of the
  Accept header: `escaping=dots` turns `kvledger_up` into `kvledger__up`;
- its OpenMetrics writer, under the default "underscores" escaping, writes sample
  names through the label-name alphabet, which has no colon:
  `sglang:kv_cache_memory_usage_gb` goes out as `sglang_kv_cache_memory_usage_gb`.
Its writers also escape every label name of every sample, which made a scrape of
8 ranks cost ~10 ms. So kvledger writes the two text formats itself
(`KvLedgerCollector.render` hands it sample lines): names exactly as declared
(every kvledger name is a valid legacy name, `exporter.metrics` refuses any
other, so no scheme would escape them), label values escaped as both formats require, label strings
memoised across scrapes. Only the format follows the Accept header: OpenMetrics
1.0.0 when the client prefers it, else the text format 0.0.4; `escaping=` is
ignored and the Content-Type names none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_LABEL_CACHE_MAX = 65536


def prefers_openmetrics(accept: str | None) -> bool:
    """True when the client ranks application/openmetrics-text above text/plain (q-values)."""
    best = {"application/openmetrics-text": -1.0, "text/plain": -1.0}
    for part in (accept or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if media not in best:
            continue
        q = 1.0
        for f in fields[1:]:
            key, _, value = f.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        best[media] = max(best[media], q)
    om_q, text_q = best["application/openmetrics-text"], best["text/plain"]
    return om_q > 0 and om_q >= text_q


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def number(v: float) -> str:
    """A sample value as both formats write it (integers without a fraction)."""
    if type(v) is int and -(2**53) < v < 2**53:
        return str(v)
    v = float(v)
    if v != v:
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(v)


class LabelMemo:
    """Label sets written as `{a="x",b="y"}` (sorted, escaped), memoised across scrapes up
    to a bound (label sets repeat from one scrape to the next; values change).

    `turn()`, at the start of each scrape, forgets the label sets no scrape used since the
    turn before: those of sources that are gone. Without it the memo kept a thousand
    departed sources' label sets (up to the bound) and, scattered among freed memory, they
    kept the process's heap from shrinking."""

    def __init__(self, bound: int = _LABEL_CACHE_MAX) -> None:
        self.bound = bound
        # Keyed by the names then the values, flat: one tuple per label set, not one per
        # label (a dict of n labels gives 2n items, the first n its names: unambiguous). With
        # 1,000 sources the per-label pairs were 96,000 small objects, the largest part of
        # the exporter's peak; the flat key is also quicker to build and hash.
        self._memo: dict[tuple[str, ...], str] = {}
        self._older: dict[tuple[str, ...], str] = {}  # used before the last turn

    def __len__(self) -> int:
        return len(self._memo) + len(self._older)

    def turn(self) -> None:
        self._older, self._memo = self._memo, {}

    def __call__(self, labels: dict[str, str]) -> str:
        key = (*labels, *labels.values())
        s = self._memo.get(key)
        if s is None:
            s = self._older.get(key)
            if s is None:
                s = (
                    "{"
                    + ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
                    + "}"
                    if labels
                    else ""
                )
            if len(self._memo) >= self.bound:
                self._memo.clear()
            self._memo[key] = s
        return s


# One metric family as text: (name, type, help, its sample lines, each ending in a newline).
Block = tuple[str, str, str, Sequence[str]]


@functools.lru_cache(maxsize=1024)  # a fixed table of metrics (exporter.metrics.METRICS)
def _header(name: str, mtype: str, doc: str, openmetrics: bool) -> str:
    """A metric family's HELP and TYPE lines in either format."""
    if not openmetrics and mtype == "counter":
        name += "_total"
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        doc = doc.replace('"', r"\"")
    elif mtype == "unknown":
        mtype = "untyped"
    return f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n"


def write_blocks(blocks: Iterable[Block], *, openmetrics: bool) -> bytes:
    """The exposition of `blocks` in either format (headers differ, sample lines do not)."""
    out: list[str] = []
    for name, mtype, doc, lines in blocks:
        out.append(_header(name, mtype, doc, openmetrics))
        out.extend(lines)
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode()


def content_type(accept: str | None) -> tuple[bool, str]:
    """(write OpenMetrics?, the Content-Type) for a scrape with this Accept header."""
    if prefers_openmetrics(accept):
        return True, OPENMETRICS_CONTENT_TYPE
    return False, TEXT_CONTENT_TYPE
