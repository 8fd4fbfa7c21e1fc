"""`GET /debug/kv` for a person: the same snapshot as a self-contained HTML page.

The page (`exporter/static/debug_kv.html`) carries its CSS and JavaScript inline,
loads nothing from elsewhere (no build step, no CDN), embeds the JSON document it
was served with, and then refreshes itself by fetching the same URL with
`Accept: application/json` (filters in the query string carry over).

`wants_html(accept)` is the content negotiation: HTML only when the client names
`text/html` and ranks it above `application/json`; `*/*`, a missing header and
anything else get the JSON, so scripts and curl see no change.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

TEMPLATE = "static/debug_kv.html"
DATA_MARK = "__KVLEDGER_DATA__"
REFRESH_MARK = "__KVLEDGER_REFRESH_MS__"
DEFAULT_REFRESH_SECONDS = 2.0


@cache
def template() -> str:
    text = resources.files("exporter").joinpath(TEMPLATE).read_text(encoding="utf-8")
    for mark in (DATA_MARK, REFRESH_MARK):
        if text.count(mark) != 1:
            raise RuntimeError(f"{TEMPLATE}: expected the mark {mark} exactly once")
    return text


def _media_ranges(accept: str) -> list[tuple[str, float]]:
    out = []
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        media, q = fields[0].lower(), 1.0
        for f in fields[1:]:
            key, _, value = f.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if media:
            out.append((media, q))
    return out


def _quality(ranges: list[tuple[str, float]], media: str, *, wildcards: bool) -> float:
    kind = media.split("/")[0] + "/*"
    exact = [q for m, q in ranges if m == media]
    if exact:
        return max(exact)
    if not wildcards:
        return 0.0
    partial = [q for m, q in ranges if m == kind]
    if partial:
        return max(partial)
    return max((q for m, q in ranges if m == "*/*"), default=0.0)


def wants_html(accept: str | None) -> bool:
    """True when the Accept header names text/html and prefers it to application/json."""
    ranges = _media_ranges(accept or "")
    html = _quality(ranges, "text/html", wildcards=False)
    return html > 0 and html > _quality(ranges, "application/json", wildcards=True)


def render(doc: dict[str, Any], *, refresh_seconds: float = DEFAULT_REFRESH_SECONDS) -> str:
    """The page for one /debug/kv document (the JSON form's dict)."""
    if not refresh_seconds > 0:
        raise ValueError(f"render: refresh_seconds={refresh_seconds!r}, expected a positive number")
    # Inside <script>, "</script" or "<!--" would end or derail the element: JSON escapes "<".
    data = json.dumps(doc, separators=(",", ":")).replace("<", "\\u003c")
    page = template().replace(REFRESH_MARK, str(round(refresh_seconds * 1000)))
    return page.replace(DATA_MARK, data)
