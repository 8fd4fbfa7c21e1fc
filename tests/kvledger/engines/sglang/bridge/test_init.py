"""The bridge package: importing it needs neither sglang nor a GPU."""

from __future__ import annotations

from tests.imports import imported_after


def test_importing_the_bridge_does_not_import_sglang() -> None:
    code = "import kvledger.engines.sglang.bridge, accounting, allocator"
    assert imported_after(code, ("sglang",)) == []
