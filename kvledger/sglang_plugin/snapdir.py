"""Where a rank publishes: `KVLEDGER_SNAPSHOT_DIR`, else the directory `kvledger serve` reads."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvledger.sglang_plugin import ENV_SNAPSHOT_DIR


def snapshot_dir(env: Mapping[str, str] | None = None) -> str:
    value = (os.environ if env is None else env).get(ENV_SNAPSHOT_DIR, "")
    if value:
        return value
    return _default()


def _default() -> str:
    # The shared default lives with `kvledger serve`; one line to switch to
    # accounting.snapdir.default_snapshot_dir() once that module is on main.
    from kvledger.demo import default_snapshot_dir

    return default_snapshot_dir()
