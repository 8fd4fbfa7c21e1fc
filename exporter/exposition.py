"""Rendering `/metrics`: the format follows the Accept header, the names never do.

Two traps in prometheus-client 0.2x, both seen here with 0.26:
- its own negotiation (`choose_encoder`) honours an `escaping=` parameter of the
  Accept header: `escaping=dots` turns `kvledger_up` into `kvledger__up`;
- its OpenMetrics writer, under the default "underscores" escaping, writes each
  sample name through the label-name alphabet, which has no colon:
  `sglang:kv_cache_memory_usage_gb` goes out as `sglang_kv_cache_memory_usage_gb`.
So kvledger ignores `escaping=` and pins "allow-utf-8" for both writers. Under it a
valid legacy name is written unchanged and never quoted, and every kvledger name
is one (`exporter.metrics` refuses any other). Only the format follows the Accept
header: OpenMetrics 1.0.0 when the client prefers it, else the text format 0.0.4.
The Content-Type names no escaping: the names are as written.
"""

from __future__ import annotations

from prometheus_client import exposition
from prometheus_client.openmetrics import exposition as om
from prometheus_client.registry import CollectorRegistry

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_PINNED_ESCAPING = "allow-utf-8"


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


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) for a scrape with this Accept header."""
    if prefers_openmetrics(accept):
        return (
            om.generate_latest(registry, escaping=_PINNED_ESCAPING, version="1.0.0"),
            OPENMETRICS_CONTENT_TYPE,
        )
    return exposition.generate_latest(registry, escaping=_PINNED_ESCAPING), TEXT_CONTENT_TYPE
