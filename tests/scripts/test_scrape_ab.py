"""`scripts/scrape-ab`: what it refuses, in one line with exit 2, before running anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "scrape-ab"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_a_directory_that_is_not_a_kvledger_tree_is_refused_by_name(tmp_path: Path) -> None:
    proc = _run(str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"scripts/scrape-ab: {tmp_path}: no kvledger/tools/bench/scrape.py (or "
        "kvledger/bench/scrape.py), expected a kvledger tree"
    )


def test_rounds_must_be_a_positive_integer() -> None:
    for bad in ("0", "-1", "x"):
        proc = _run(str(ROOT), str(ROOT), bad)
        assert proc.returncode == 2, bad
        assert f"ROUNDS={bad}, expected a positive integer" in proc.stderr
