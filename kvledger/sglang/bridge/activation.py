"""The bridge's opt-in switches, read from the environment.

    KVLEDGER_SGLANG_DSV4_BRIDGE=1          put the SWA KV buffers on kvledger's VMM pool
    KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE=1  an incompatible pool fails start-up instead of
                                           keeping SGLang's own buffers

Both are needed together with a call to `attach`: the variable alone changes
nothing, and `attach` without it only registers the pool with the ledger.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from allocator.activation import env_flag

ENV_ENABLE = "KVLEDGER_SGLANG_DSV4_BRIDGE"
ENV_REQUIRE = "KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE"


@dataclass(frozen=True)
class BridgeActivation:
    enabled: bool = False
    require: bool = False

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, require: bool | None = None
    ) -> BridgeActivation:
        """Switches from `env` (default os.environ); `require`, when given, overrides the
        environment's."""
        env = os.environ if env is None else env
        req = env_flag(env, ENV_REQUIRE) if require is None else bool(require)
        return cls(enabled=env_flag(env, ENV_ENABLE), require=req)
