"""DeepSeek-V4 (and V4.1) KV layout and sizing, as SGLang 0.5.23 plans and allocates it.

shape = load_config("config.json")          # Dsv4Shape, or ConfigError (bounded read)
bm = plan(shape, Knobs(), budget_bytes=80 << 30)   # or full_tokens=...
bm.buffers                                   # every tensor of the seven families (V4.1:
                                             # and of the low-ratio ones, LOW_RATIO_FAMILIES)
bm.kv_layout                                 # "v4", "v41" or "v41_new" (Knobs.kv_layout)
bm.families["c128_kv"].planned_bytes, .allocated_bytes
ledger.add_account(...) over bm.specs(pool="dsv4")
"""

from kvledger.engines.sglang.dsv4.buffermap import (
    ALL_FAMILIES,
    FAMILIES,
    LOW_RATIO_FAMILIES,
    BufferMap,
    Dsv4Buffer,
    FamilyPlan,
    plan,
)
from kvledger.engines.sglang.dsv4.knobs import Knobs
from kvledger.engines.sglang.dsv4.planner import PoolSizes, Pricing
from kvledger.engines.sglang.dsv4.shape import ConfigError, Dsv4Shape, from_dict, load_config

__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "LOW_RATIO_FAMILIES",
    "BufferMap",
    "ConfigError",
    "Dsv4Buffer",
    "Dsv4Shape",
    "FamilyPlan",
    "Knobs",
    "PoolSizes",
    "Pricing",
    "from_dict",
    "load_config",
    "plan",
]
