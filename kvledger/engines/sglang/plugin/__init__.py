"""kvledger inside an unmodified SGLang 0.5.23 server, through SGLang's general-plugin framework.

SGLang's `load_plugins()` (every scheduler process, the engine, the detokenizer, the DP
controller) calls `register` through the entry point `kvledger` in the group
`sglang.srt.plugins`. With `KVLEDGER_SGLANG` unset (or 0) it returns at once: no hook is
registered and nothing is imported beyond this module and the switch it reads
(`kvledger.engines.sglang.switches`, `accounting.switches`). With `KVLEDGER_SGLANG=1` it registers
kvledger's hooks with SGLang's `HookRegistry` (see `server_hooks`), which SGLang applies
right after. The environment variables it and the bridge read are listed in
`kvledger.engines.sglang.switches`. See docs/sglang-plugin.md.
"""

from __future__ import annotations

from accounting.switches import switch
from kvledger.engines.sglang import switches

# The plugin's names for its variables (kvledger.engines.sglang.switches lists them all).
ENV_ENABLE = switches.PLUGIN_ENABLE
ENV_REQUIRE = switches.PLUGIN_REQUIRE
ENV_SNAPSHOT_DIR = switches.SNAPSHOT_DIR
ENV_INTERVAL = switches.PUBLISH_INTERVAL


def register() -> None:
    """The `sglang.srt.plugins` entry point. Registers hooks only with KVLEDGER_SGLANG=1."""
    if not switches.plugin_enabled():
        return
    from kvledger.engines.sglang.plugin.server_hooks import install

    install()


__all__ = ["ENV_ENABLE", "ENV_INTERVAL", "ENV_REQUIRE", "ENV_SNAPSHOT_DIR", "register", "switch"]
