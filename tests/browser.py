"""Headless Chromium (Debian's `chromium`) for page tests: dump the DOM after the page's scripts
ran, or take a screenshot. A fresh empty profile per call, removed afterwards; loopback only."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

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
