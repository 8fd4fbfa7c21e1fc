"""Where a rank publishes: `KVLEDGER_SNAPSHOT_DIR`, else the directory `kvledger serve` reads."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvledger.engines.sglang.switches import SNAPSHOT_DIR


def snapshot_dir(env: Mapping[str, str] | None = None) -> str:
    value = (os.environ if env is None else env).get(SNAPSHOT_DIR, "")
    if value:
        return value
    from accounting.snapfile.directory import default_snapshot_dir

    return default_snapshot_dir()
