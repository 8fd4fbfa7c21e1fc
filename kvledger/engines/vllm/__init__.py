"""kvledger inside an unmodified vLLM server (0.32, 0.33, 0.34), through vLLM's general-plugin
entry points.

vLLM's `load_general_plugins()` runs in every vLLM process (API server, engine core,
workers) and calls every `vllm.general_plugins` entry point once per process
(`VLLM_PLUGINS` is an allowlist of their names). kvledger's is `register`: with
`KVLEDGER_VLLM` unset (or 0) it returns at once, having imported nothing beyond
`kvledger`, this module and `accounting.switches` (the one yes/no parser). With `KVLEDGER_VLLM=1` it patches, once per process:

- the worker's KV allocation (the V1 runner's `GPUModelRunner.initialize_kv_cache_tensors`,
  or 0.34's V2 runner's `initialize_kv_cache`, chosen by what the classes offer:
  `kvledger.engines.vllm.compat`): each KV-cache group's tensors become accounts of the
  worker's ledger (`kvledger.engines.vllm.groups`); 0.34's extensible (VMM) KV cache is
  followed as vLLM commits and releases it (`kvledger.engines.vllm.extensible`);
- the engine core's scheduler (`Scheduler.__init__`, `schedule`, `shutdown`): the block
  pool's occupancy per group becomes the engine core's ledger (`kvledger.engines.vllm.occupancy`).

Each process publishes its own file into the snapshot directory `kvledger serve` reads.
See docs/vllm.md.

    KVLEDGER_VLLM=1                    turn kvledger on in every vLLM process
    KVLEDGER_SNAPSHOT_DIR=DIR          where each process publishes (default: the directory
                                       `kvledger serve` reads)
    KVLEDGER_PUBLISH_INTERVAL=SECONDS  heartbeat of the published files (default 1)
    KVLEDGER_VLLM_REQUIRE=1            a kvledger failure fails vLLM's start-up instead of
                                       one log line
    KVLEDGER_VLLM_COST=1               (a bench tool) the engine core times kvledger's
    KVLEDGER_VLLM_COST_DIR=DIR         step-path wrappers and its steps, into DIR (cost.py)
"""

from __future__ import annotations

from kvledger.engines.vllm.switches import (
    ENV_ENABLE,
    ENV_INTERVAL,
    ENV_REQUIRE,
    ENV_SNAPSHOT_DIR,
    env_switch,
)


def register() -> None:
    """The `vllm.general_plugins` entry point: patches vLLM only with KVLEDGER_VLLM=1.
    Idempotent: a second call in the same process changes nothing."""
    if not env_switch(ENV_ENABLE):
        return
    from kvledger.engines.vllm.hooks import install

    install()


__all__ = [
    "ENV_ENABLE",
    "ENV_INTERVAL",
    "ENV_REQUIRE",
    "ENV_SNAPSHOT_DIR",
    "env_switch",
    "register",
]
