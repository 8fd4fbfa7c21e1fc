"""Old import path of `kvledger.sglang.bridge`, kept for one release.

Code outside this repository that calls `kvledger.sglang_bridge.attach(...)` keeps working;
new code imports `kvledger.sglang.bridge`.
"""

from kvledger.sglang.bridge import (
    ENV_ENABLE,
    ENV_REQUIRE,
    Bridge,
    BridgeActivation,
    SwaFacts,
    attach,
    bridge_of,
    detach,
    incompatibilities,
)

__all__ = [
    "ENV_ENABLE",
    "ENV_REQUIRE",
    "Bridge",
    "BridgeActivation",
    "SwaFacts",
    "attach",
    "bridge_of",
    "detach",
    "incompatibilities",
]
