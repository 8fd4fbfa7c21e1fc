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

ENV_ENABLE = "KVLEDGER_SGLANG_DSV4_BRIDGE"
ENV_REQUIRE = "KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={env.get(name)!r}, expected one of 1/0/true/false/yes/no/on/off")


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
