"""Every environment variable of kvledger's vLLM plugin, named once, and the one yes/no parser
(`accounting.switches`). Light: the plugin's entry point imports it with kvledger off."""

from __future__ import annotations

from accounting.switches import switch as env_switch

ENV_ENABLE = "KVLEDGER_VLLM"
ENV_REQUIRE = "KVLEDGER_VLLM_REQUIRE"
ENV_SNAPSHOT_DIR = "KVLEDGER_SNAPSHOT_DIR"
ENV_INTERVAL = "KVLEDGER_PUBLISH_INTERVAL"

__all__ = ["ENV_ENABLE", "ENV_INTERVAL", "ENV_REQUIRE", "ENV_SNAPSHOT_DIR", "env_switch"]
