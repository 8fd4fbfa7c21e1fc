"""The bridge package: importing it needs neither sglang nor a GPU."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_bridge_does_not_import_sglang() -> None:
    code = (
        "import sys; import kvledger.sglang.bridge, accounting, allocator; "
        "print(','.join(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
