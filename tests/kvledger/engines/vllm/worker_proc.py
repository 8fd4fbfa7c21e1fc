"""A vLLM worker in a process of its own, for the exporter tests: vLLM's real KVCacheConfig
for a hybrid (full + sliding-window) model, allocated through kvledger's patched
`GPUModelRunner.initialize_kv_cache_tensors` on the CPU, so the plugin publishes the
worker's file. Prints one line, MARK and JSON: what the tensors themselves say (storage bytes, and
per group its layers, the bytes its views address and their bytes per slot), then waits
to be killed or for stdin to close.

    python -m tests.kvledger.engines.vllm.worker_proc [--wait]   (KVLEDGER_SNAPSHOT_DIR etc. in the env)

`--wait`: import vLLM and plan, then allocate only once a line comes on stdin (a restart
that is ready at once).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.kvledger.engines.vllm import vllm_setup as vs

MODEL = "tiny"
MEMORY = 8 << 20
MARK = "kvledger-truth: "  # vLLM logs to stdout too: the line that is this script's


def build() -> tuple[Any, Any]:
    """The VllmConfig and KVCacheConfig the worker and the test's scheduler share."""
    cfg = vs.vllm_config(served_model_name=[MODEL])
    specs = {**vs.full_specs(4), **vs.sliding_specs(4)}
    return cfg, vs.kv_cache_config(cfg, specs, MEMORY)


def truth(config: Any, kv: dict[str, Any]) -> dict[str, Any]:
    """The figures as the tensors and the config give them, not as kvledger counts them."""
    first = next(iter(kv.values()))
    groups = []
    for i, g in enumerate(config.kv_cache_groups):
        views = [kv[n] for n in g.layer_names if n in kv]
        capacity = config.num_blocks * g.kv_cache_spec.block_size
        groups.append(
            {
                "group": i,
                "kind": vs.kind_of(g.kv_cache_spec),
                "layers": len(views),
                "block_size": g.kv_cache_spec.block_size,
                "tensor_bytes": sum(t.numel() * t.element_size() for t in views),
                "slot_bytes": sum(t.numel() * t.element_size() // capacity for t in views),
            }
        )
    storage = first.untyped_storage().nbytes()
    return {
        "storage": storage,
        "blocks": config.num_blocks,
        "block_bytes": storage // config.num_blocks,
        "groups": groups,
    }


def main() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvledger.engines.vllm import hooks

    cfg, config = build()
    if "--wait" in sys.argv[1:]:  # imported and planned; allocate when told (a restart)
        sys.stdin.readline()
    assert hooks.install(), "kvledger did not patch vLLM"
    kv = GPUModelRunner.initialize_kv_cache_tensors(vs.runner(cfg, config), config, None)
    ledger = hooks.worker_ledger()
    assert ledger is not None and ledger.publisher is not None, "the worker did not publish"
    print(MARK + json.dumps({**truth(config, kv), "path": ledger.publisher.path}), flush=True)
    sys.stdin.read()
    hooks.uninstall()


if __name__ == "__main__":
    main()
