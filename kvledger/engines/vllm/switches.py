"""Every environment variable of kvledger's vLLM plugin, named once, and the one yes/no parser
(`accounting.switches`). Light: the plugin's entry point imports it with kvledger off."""

from __future__ import annotations

from accounting.switches import switch as env_switch

ENV_ENABLE = "KVLEDGER_VLLM"
ENV_REQUIRE = "KVLEDGER_VLLM_REQUIRE"
ENV_SNAPSHOT_DIR = "KVLEDGER_SNAPSHOT_DIR"
ENV_INTERVAL = "KVLEDGER_PUBLISH_INTERVAL"
# Opt-in self-measurement of the hooks' cost (kvledger/engines/vllm/cost.py); a bench tool.
ENV_COST = "KVLEDGER_VLLM_COST"
ENV_COST_DIR = "KVLEDGER_VLLM_COST_DIR"

__all__ = [
    "ENV_COST",
    "ENV_COST_DIR",
    "ENV_ENABLE",
    "ENV_INTERVAL",
    "ENV_REQUIRE",
    "ENV_SNAPSHOT_DIR",
    "env_switch",
]
