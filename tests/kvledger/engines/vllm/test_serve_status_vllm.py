"""`kvledger serve`'s status line for a vLLM engine core: its blocks, never an `sglang:`
metric's name nor an `occupied 0 B` made of slots that carry no bytes."""

from __future__ import annotations

from accounting.ledger import Ledger
from exporter.sources import Sources
from kvledger.engines.vllm.occupancy import EVICTABLE_FAMILY, _set, _slot_account
from kvledger.serve import status_line


def test_a_loaded_vllm_engine_core_is_said_in_blocks() -> None:
    ledger = Ledger({"model_name": "tiny", "engine": "0", "engine_type": "vllm_scheduler"})
    pool = _slot_account(ledger, "vllm", "kv_pool", 2048)
    evictable = _slot_account(ledger, "vllm", EVICTABLE_FAMILY, 2048)
    group = _slot_account(ledger, "vllm", "g0_full_attention", 2048 * 32)
    _set(pool, 49)
    _set(evictable, 7)
    _set(group, 48 * 32)
    sources = Sources()
    sources.add_ledger(ledger)
    line = status_line(sources, None, 3.0)
    assert "vllm tiny/0 blocks occupied 49/2048 evictable 7" in line, line
    assert "sglang:" not in line and "occupied 0 B" not in line, line
