"""The SGLang wing's environment: every variable it reads and what it means.

    KVLEDGER_SGLANG=1                      the plugin registers kvledger's hooks in every
                                           SGLang process (`kvledger.engines.sglang.plugin`)
    KVLEDGER_SGLANG_REQUIRE=1              a kvledger failure in those hooks fails SGLang's
                                           start-up instead of being logged
    KVLEDGER_SGLANG_DSV4_BRIDGE=1          `kvledger.engines.sglang.bridge.attach` puts DeepSeek-V4's
                                           SWA KV buffers on kvledger's VMM pool
    KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE=1  an incompatible pool fails start-up instead of
                                           keeping SGLang's own buffers
    KVLEDGER_SGLANG_DSV4_COMPACT=0         a bridged pool is not compacted (on by default:
                                           `kvledger.engines.sglang.bridge.compact_policy`, run by
                                           the plugin between batches and when idle)
    KVLEDGER_SGLANG_DSV4_COMPACT_SLACK=N   page ids a bridged pool may keep mapped beyond the
                                           packing bound before a step compacts it back to
                                           the bound (default 2, chosen from the serving
                                           loop's curve; 0: compact as soon as it is over;
                                           N trades up to N page ids of memory for fewer,
                                           larger compactions: docs/sglang-bridge.md)
    KVLEDGER_SNAPSHOT_DIR=DIR              where each rank publishes (default: the directory
                                           `kvledger serve` reads)
    KVLEDGER_PUBLISH_INTERVAL=SECONDS      heartbeat of the published file (default 1)
    KVLEDGER_SGLANG_NATIVE_MEM_USAGE=1     leave SGLang's own `mem_usage` of each pool as
                                           SGLang computes it (by default the plugin sets it
                                           to kvledger's physical bytes, in SGLang's GB:
                                           `kvledger.engines.sglang.mem_usage`)

The yes/no switches are read by `accounting.switches.switch` (the one parser: unset, empty,
0/false/no/off is off, 1/true/yes/on is on, anything else an error naming the variable);
`KVLEDGER_SGLANG_DSV4_COMPACT` alone is on when unset or empty. The slack is a count
(`compaction_slack`: digits only, a bad value an error naming it). The bridge switch alone
changes nothing: it takes effect in a call to `attach`, and `attach` without it only
registers the pool with the ledger.

Imports only `accounting.switches`: the plugin's entry point reads `KVLEDGER_SGLANG` through
here in every SGLang process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from accounting.switches import switch

PLUGIN_ENABLE = "KVLEDGER_SGLANG"
PLUGIN_REQUIRE = "KVLEDGER_SGLANG_REQUIRE"
BRIDGE_ENABLE = "KVLEDGER_SGLANG_DSV4_BRIDGE"
BRIDGE_REQUIRE = "KVLEDGER_SGLANG_DSV4_BRIDGE_REQUIRE"
COMPACT = "KVLEDGER_SGLANG_DSV4_COMPACT"
COMPACT_SLACK = "KVLEDGER_SGLANG_DSV4_COMPACT_SLACK"
MAX_COMPACT_SLACK = 1024  # page ids; a larger slack is a typo, not a policy
# The default, from `kvledger bench sglang --part serving` on an H100 (docs/sglang-bridge.md,
# "Compaction in a server"): at a 15 ms forward, slack 2 kept tokens/s at 0.9999x native
# [0.9993, 1.0001] against 0.9959x [0.9930, 0.9971] at slack 0, with 14x fewer compactions
# and the SWA family's physical bytes at 0.250x native against 0.246x.
DEFAULT_COMPACT_SLACK = 2
SNAPSHOT_DIR = "KVLEDGER_SNAPSHOT_DIR"
PUBLISH_INTERVAL = "KVLEDGER_PUBLISH_INTERVAL"
DEFAULT_PUBLISH_INTERVAL = 1.0  # seconds, where PUBLISH_INTERVAL is unset
NATIVE_MEM_USAGE = "KVLEDGER_SGLANG_NATIVE_MEM_USAGE"


def mem_usage_fixed(env: Mapping[str, str] | None = None) -> bool:
    """Whether the plugin writes kvledger's KV bytes into SGLang's `mem_usage` (on unless
    `KVLEDGER_SGLANG_NATIVE_MEM_USAGE`; a malformed value raises)."""
    return not switch(NATIVE_MEM_USAGE, env)


def plugin_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`KVLEDGER_SGLANG` (default env: os.environ); a malformed value raises."""
    return switch(PLUGIN_ENABLE, env)


def plugin_required(env: Mapping[str, str] | None = None) -> bool:
    """`KVLEDGER_SGLANG_REQUIRE`; a malformed value counts as on (it is not a "no")."""
    try:
        return switch(PLUGIN_REQUIRE, env)
    except ValueError:
        return True


def compaction_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`KVLEDGER_SGLANG_DSV4_COMPACT`: on when unset or empty; a malformed value raises."""
    raw = (os.environ if env is None else env).get(COMPACT, "")
    return True if not raw.strip() else switch(COMPACT, {COMPACT: raw})


def compaction_slack(env: Mapping[str, str] | None = None) -> int:
    """`KVLEDGER_SGLANG_DSV4_COMPACT_SLACK`: DEFAULT_COMPACT_SLACK when unset or empty, else
    a whole number of page ids in 0..MAX_COMPACT_SLACK; anything else raises ValueError
    naming the variable, its value and what was expected."""
    raw = (os.environ if env is None else env).get(COMPACT_SLACK, "")
    text = raw.strip()
    if not text:
        return DEFAULT_COMPACT_SLACK
    if text.isascii() and text.isdigit() and len(text) <= 5:
        n = int(text)
        if n <= MAX_COMPACT_SLACK:
            return n
    raise ValueError(
        f"{COMPACT_SLACK}={raw[:40]!r}, expected a whole number of page ids from 0 to "
        f"{MAX_COMPACT_SLACK}"
    )


@dataclass(frozen=True)
class BridgeActivation:
    """The bridge's two switches."""

    enabled: bool = False
    require: bool = False

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, require: bool | None = None
    ) -> BridgeActivation:
        """Switches from `env` (default os.environ); `require`, when given, overrides the
        environment's."""
        req = switch(BRIDGE_REQUIRE, env) if require is None else bool(require)
        return cls(enabled=switch(BRIDGE_ENABLE, env), require=req)
