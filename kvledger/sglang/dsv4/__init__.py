"""DeepSeek-V4 KV layout and sizing, as SGLang 0.5.23 plans and allocates it.

shape = load_config("config.json")          # Dsv4Shape, or ConfigError
bm = plan(shape, Knobs(), budget_bytes=80 << 30)   # or full_tokens=...
bm.buffers                                   # every tensor of the seven families
bm.families["c128_kv"].planned_bytes, .allocated_bytes
ledger.add_account(...) over bm.specs(pool="dsv4")
"""

from kvledger.sglang.dsv4.buffermap import FAMILIES, BufferMap, Dsv4Buffer, FamilyPlan, plan
from kvledger.sglang.dsv4.knobs import Knobs
from kvledger.sglang.dsv4.planner import PoolSizes, Pricing
from kvledger.sglang.dsv4.shape import ConfigError, Dsv4Shape, from_dict, load_config

__all__ = [
    "FAMILIES",
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
