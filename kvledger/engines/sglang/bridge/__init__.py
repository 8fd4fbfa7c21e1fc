"""Opt-in SGLang 0.5.23 DeepSeek-V4 bridge: the SWA KV buffers on kvledger's VMM pool.

    KVLEDGER_SGLANG_DSV4_BRIDGE=1 and
    bridge = attach(pool, ledger, allocator=token_to_kv_pool_allocator)
    ...
    bridge.detach()

Only `bridge.attach` imports sglang, and only when the bridge is switched on;
importing this package needs neither sglang nor a GPU. See docs/sglang-bridge.md.
"""

from allocator.rows import RowFollower
from kvledger.engines.sglang.bridge.bridge import Bridge, attach, bridge_of, detach
from kvledger.engines.sglang.bridge.compat import SwaFacts, incompatibilities
from kvledger.engines.sglang.switches import BRIDGE_ENABLE, BRIDGE_REQUIRE, BridgeActivation

# The bridge's names for its two switches (kvledger.engines.sglang.switches lists every variable).
ENV_ENABLE = BRIDGE_ENABLE
ENV_REQUIRE = BRIDGE_REQUIRE

__all__ = [
    "ENV_ENABLE",
    "ENV_REQUIRE",
    "Bridge",
    "BridgeActivation",
    "RowFollower",
    "SwaFacts",
    "attach",
    "bridge_of",
    "detach",
    "incompatibilities",
]
