"""`kvledger serve`'s status log line: each figure's value is followed by that figure's unit."""

from __future__ import annotations

import re

from accounting.units import format_size
from exporter.sources import Sources
from kvledger.serve import status_line
from tests.ledgers import small_ledger

BINARY = r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)"


def test_each_figure_carries_its_own_unit():
    with small_ledger() as sl:
        sl.allocate(900)
        sources = Sources()
        sources.add_ledger(sl.ledger)
        line = status_line(sources, None, 12.0)
        snap = sl.ledger.snapshot()
    physical = snap.total("physical_bytes")
    assert f"physical {format_size(physical)} " in line
    assert f"(sglang:kv_cache_memory_usage_gb {physical / 2**30:.3f} GiB)" in line
    assert f"mapped {format_size(snap.total('mapped_bytes'))} " in line
    assert re.search(rf"occupied {BINARY}( |$)", line), line
    assert re.search(rf"unattributed -?{BINARY}$", line), line
    # no decimal unit anywhere: every figure here is in binary units or GiB
    assert not re.search(r"\bGB\b|\bMB\b", line), line
