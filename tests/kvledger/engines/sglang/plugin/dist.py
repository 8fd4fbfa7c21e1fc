"""kvledger's `sglang.srt.plugins` entry point where kvledger runs from a source tree without
being installed (the device machine runs a copy of the working tree): a dist-info folder with
the entry points of pyproject.toml, put on the child's path, is what an install would write."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
GROUP = "sglang.srt.plugins"


def installed() -> bool:
    return any(ep.name == "kvledger" for ep in entry_points(group=GROUP))


def write_dist_info(where: Path) -> Path:
    """`where/kvledger-<version>.dist-info` with METADATA and entry_points.txt; returns `where`."""
    import tomllib  # Python >= 3.11; the device machine runs 3.12

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    __version__ = project["version"]
    info = where / f"kvledger-{__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: kvledger\nVersion: {__version__}\n"
    )
    lines = [f"[{GROUP}]"]
    lines += [f"{k} = {v}" for k, v in project["entry-points"][GROUP].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return where
