"""`GET /debug/kv` for a person: the same snapshot as a self-contained HTML page.

`page(doc)` is the app's `debug_html` hook (`create_app(..., debug_html=page)`, which
`kvledger serve` passes): the route calls it with the `DebugKv` document when a
browser asks for text/html (`exporter.app.wants_html`), and serves the JSON to
everyone else. The page (`exporter/static/debug_kv.html`) carries its CSS and
JavaScript inline, loads nothing from elsewhere (no build step, no CDN), embeds the
document it was served with, and then refreshes itself by fetching the same URL
with `Accept: application/json` (filters in the query string carry over).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from exporter.debug_schema import DebugKv

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


def render(doc: dict[str, Any], *, refresh_seconds: float = DEFAULT_REFRESH_SECONDS) -> str:
    """The page for one /debug/kv document (the JSON form's dict)."""
    if not refresh_seconds > 0:
        raise ValueError(f"render: refresh_seconds={refresh_seconds!r}, expected a positive number")
    # Inside <script>, "</script" or "<!--" would end or derail the element: JSON escapes "<".
    data = json.dumps(doc, separators=(",", ":")).replace("<", "\\u003c")
    page_text = template().replace(REFRESH_MARK, str(round(refresh_seconds * 1000)))
    return page_text.replace(DATA_MARK, data)


def page(doc: DebugKv) -> str:
    """The `debug_html` hook: the page for the route's `DebugKv` document."""
    return render(doc.model_dump(mode="json"))
