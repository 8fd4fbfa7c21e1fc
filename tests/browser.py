"""Headless Chromium (Debian's `chromium`) for page tests: dump the DOM after the page's scripts
ran, or take a screenshot. A fresh empty profile per call, removed afterwards; loopback only."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def available() -> bool:
    return Path(CHROMIUM).exists()


def _run(url: str, *extra: str, budget_ms: int, timeout: float) -> subprocess.CompletedProcess[str]:
    if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
        raise ValueError(f"browser: url={url!r}, expected a loopback http URL")
    with tempfile.TemporaryDirectory(prefix="kvledger-chromium-") as profile:
        return subprocess.run(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--virtual-time-budget={budget_ms}",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def dump_dom(url: str, *, budget_ms: int = 5000, timeout: float = 60) -> str:
    r = _run(url, "--dump-dom", budget_ms=budget_ms, timeout=timeout)
    if r.returncode != 0 or "<html" not in r.stdout:
        raise RuntimeError(f"chromium --dump-dom {url}: exit {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def dump_dom_and_requests(
    url: str, *, budget_ms: int = 5000, timeout: float = 60
) -> tuple[str, set[str]]:
    """The DOM after the page's scripts ran, and every URL the page had loaded (the document,
    its subresources, its fetches), from Chromium's net log. Names outside loopback do not
    resolve (`--host-resolver-rules`), so a page that reaches out shows it here, never on the
    wire."""
    with tempfile.TemporaryDirectory(prefix="kvledger-netlog-") as d:
        log = Path(d) / "net.json"
        r = _run(
            url,
            "--dump-dom",
            f"--log-net-log={log}",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
            budget_ms=budget_ms,
            timeout=timeout,
        )
        if r.returncode != 0 or "<html" not in r.stdout:
            raise RuntimeError(
                f"chromium --dump-dom {url}: exit {r.returncode}: {r.stderr[-2000:]}"
            )
        return r.stdout, page_requests(json.loads(log.read_text(errors="replace")), url)


def page_requests(netlog: Any, url: str) -> set[str]:
    """URLs of the requests in the page's network partition (its top frame's site: the
    document and all it loads, from any origin). Chromium's own background requests
    (updates, clock, spelling lists) carry other partitions and are left out."""
    site = "http://" + url.removeprefix("http://").split("/")[0].split(":")[0]
    key = f"{site} {site}"
    names = {v: k for k, v in netlog["constants"]["logEventTypes"].items()}
    out: set[str] = set()
    for event in netlog.get("events", ()):
        params = event.get("params") or {}
        if names.get(event.get("type")) != "URL_REQUEST_START_JOB":
            continue
        if params.get("network_isolation_key") == key and isinstance(params.get("url"), str):
            out.add(params["url"])
    return out


def screenshot(
    url: str, path: Path, *, size: tuple[int, int] = (1400, 1100), budget_ms: int = 5000
) -> Path:
    r = _run(
        url,
        f"--screenshot={path}",
        f"--window-size={size[0]},{size[1]}",
        budget_ms=budget_ms,
        timeout=60,
    )
    if r.returncode != 0 or not path.exists():
        raise RuntimeError(f"chromium --screenshot {url}: exit {r.returncode}: {r.stderr[-2000:]}")
    return path


class DataAttributes(HTMLParser):
    """Collects the attributes of every element carrying a `data-*` attribute or an id, and the
    text a reader sees (not the scripts' or styles')."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict[str, str]] = []
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        d = {k: v or "" for k, v in attrs}
        if any(k.startswith("data-") for k in d) or "id" in d:
            self.elements.append({"tag": tag, **d})

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


def parse(dom: str) -> DataAttributes:
    p = DataAttributes()
    p.feed(dom)
    return p
