"""kvledger inside an unmodified SGLang 0.5.23 server, through SGLang's general-plugin framework.

SGLang's `load_plugins()` (every scheduler process, the engine, the detokenizer, the DP
controller) calls `register` through the entry point `kvledger` in the group
`sglang.srt.plugins`. With `KVLEDGER_SGLANG` unset (or 0) it returns at once: no hook is
registered and nothing beyond this module is imported. With `KVLEDGER_SGLANG=1` it
registers kvledger's hooks with SGLang's `HookRegistry` (see `hooks`), which SGLang
applies right after. See docs/sglang-plugin.md.

    KVLEDGER_SGLANG=1                      turn kvledger on in every SGLang process
    KVLEDGER_SNAPSHOT_DIR=DIR              where each rank publishes (default: the directory
                                           `kvledger serve` reads)
    KVLEDGER_PUBLISH_INTERVAL=SECONDS      heartbeat of the published file (default 1)
    KVLEDGER_SGLANG_REQUIRE=1              a kvledger failure fails SGLang's start-up instead
                                           of being logged
    KVLEDGER_SGLANG_DSV4_BRIDGE=1          DeepSeek-V4 SWA buffers on kvledger's VMM pool
    KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE=1  an incompatible pool fails start-up
"""

from __future__ import annotations

import os

ENV_ENABLE = "KVLEDGER_SGLANG"
ENV_REQUIRE = "KVLEDGER_SGLANG_REQUIRE"
ENV_SNAPSHOT_DIR = "KVLEDGER_SNAPSHOT_DIR"
ENV_INTERVAL = "KVLEDGER_PUBLISH_INTERVAL"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def switch(name: str, env: dict[str, str] | None = None) -> bool:
    """A yes/no environment switch; anything else is an error naming the variable."""
    raw = (os.environ if env is None else env).get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}, expected one of 1/0/true/false/yes/no/on/off")


def register() -> None:
    """The `sglang.srt.plugins` entry point. Registers hooks only with KVLEDGER_SGLANG=1."""
    if not switch(ENV_ENABLE):
        return
    from kvledger.sglang.plugin.server_hooks import install

    install()


__all__ = ["ENV_ENABLE", "ENV_INTERVAL", "ENV_REQUIRE", "ENV_SNAPSHOT_DIR", "register", "switch"]
