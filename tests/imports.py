"""What a fresh interpreter imports: for tests of import-time promises (the plugin's entry
point with kvledger off, the one switch parser, the bridge without sglang)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The plugin's entry point with KVLEDGER_SGLANG off: itself, and the switch it reads (the
# wing's names and the one parser; accounting's `__init__` imports nothing eagerly).
ENTRY_POINT_OFF = [
    "accounting",
    "accounting.switches",
    "kvledger",
    "kvledger.engines",
    "kvledger.engines.sglang",
    "kvledger.engines.sglang.plugin",
    "kvledger.engines.sglang.switches",
]


def imported_after(code: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of `packages` (top-level names) imported once `code` has run in a new
    interpreter of this venv, with this repository first on its path, sorted."""
    probe = (
        f"{code}\nimport sys as _s\n"
        f"print(sorted(m for m in _s.modules if m.split('.')[0] in {packages!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return list(json.loads(out.strip().splitlines()[-1].replace("'", '"')))
