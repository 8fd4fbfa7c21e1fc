"""vLLM 0.34's `ExtensibleKVCache` on a real GPU through kvledger's hook (marker `gpu`): the
CPU tier's test (test_extensible.py) with CUDA's VMM driver in place of the host stand-in,
and the device's own free memory as the truth.

Needs most of vLLM 0.34's Python files (its KV modules import vllm.config and what that
pulls in): `scripts/vllm-subset --modules ...` packs them in two parts and
`scripts/gpu-check-vllm034` unpacks and runs this (docs/vllm.md, "vLLM 0.34 tier").
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MIB = 1 << 20
SLACK = 8 * MIB  # what the driver may take beside the chunks (page tables), at most


@pytest.fixture
def snapdir(tmp_path, monkeypatch):
    from kvledger.engines.vllm import hooks

    d = tmp_path / "snap"
    monkeypatch.setenv("KVLEDGER_SNAPSHOT_DIR", str(d))
    monkeypatch.setenv("KVLEDGER_PUBLISH_INTERVAL", "0.05")
    monkeypatch.setenv("KVLEDGER_VLLM_REQUIRE", "1")  # a kvledger failure fails the test
    yield d
    hooks.uninstall()


def test_extensible_kv_cache_on_cuda_through_the_v2_hook(snapdir, monkeypatch) -> None:
    pytest.importorskip("vllm.v1.worker.extensible_kv_cache")
    import torch
    import vllm

    if not str(vllm.__version__).startswith("0.34."):
        pytest.skip(f"vLLM {vllm.__version__} is not 0.34")
    from vllm.utils.extensible_tensor import granule_size
    from vllm.utils.vmm_driver import vmm_unavailable_reason
    from vllm.v1.worker.extensible_kv_cache import ensure_kv_cache_blocks
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from kvledger.engines.vllm import hooks
    from tests.kvledger.engines.vllm import vllm_setup as vs
    from tests.kvledger.engines.vllm.v034 import runner_v2

    torch.cuda.init()
    assert vmm_unavailable_reason() is None, vmm_unavailable_reason()
    monkeypatch.setattr(GPUModelRunner, "initialize_kv_cache", runner_v2.initialize_kv_cache)
    cfg = runner_v2.vllm_config(served_model_name=["tiny"])
    specs = {**vs.full_specs(4), **vs.sliding_specs(4)}
    granule = granule_size(0)
    config = runner_v2.padded(cfg, vs.kv_cache_config(cfg, specs, 1 << 30), granule)
    runner = runner_v2.runner(cfg, config, "cuda:0")
    assert hooks.install()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    torch0 = torch.cuda.memory_reserved()
    GPUModelRunner.initialize_kv_cache(runner, config, extensible=True)
    cache = runner.extensible_kv_cache
    worker = hooks.worker_ledger()
    assert worker is not None and cache is not None
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "granule": granule,
        "capacity_blocks": cache.capacity_blocks,
        "reserved": cache.buffer.capacity_bytes,
    }

    def check(name: str, blocks: int) -> dict[str, int]:
        torch.cuda.synchronize()
        snap = worker.ledger.snapshot(reconcile=False)
        assert not snap.violations, snap.violations
        [row] = [b for b in snap.buffers if b.spec.family == "kv_pool"]
        [committed] = [a for a in snap.accounts if a.family == "kv_pool_committed"]
        f = {
            "physical": row.physical_bytes,
            "device_used": free0 - torch.cuda.mem_get_info()[0],
            "torch_reserved": torch.cuda.memory_reserved() - torch0,
            "committed": committed.occupied_slots,
        }
        report[name] = f
        assert f["physical"] == cache.physical_bytes and f["committed"] == blocks
        assert row.spec.reserved_bytes == cache.buffer.capacity_bytes
        assert row.spec.tensor_bytes == cache.size
        assert abs(f["device_used"] - f["physical"]) <= SLACK, report
        return f

    try:
        check("allocated", cache.min_committed_blocks)
        grow = cache.capacity_blocks // 2
        ensure_kv_cache_blocks(runner, grow)  # warm-up
        check("warm-up", grow)
        view = next(iter(runner.kv_caches_by_layer.values()))
        view[:grow].fill_(1)  # committed blocks are real device memory
        torch.cuda.synchronize()
        small = cache.capacity_blocks // 8
        cache.commit(small, shrink=True)  # extend_kv_cache's remap
        check("shrunk", small)
        cache.release_physical()  # sleep
        assert check("released", 0)["physical"] == 0
        cache.recommit()  # wake-up
        check("recommitted", small)
        path = worker.publisher.path
        cache.free()  # the runner's shutdown
        torch.cuda.synchronize()
        report["freed_device_used"] = free0 - torch.cuda.mem_get_info()[0]
        assert hooks.worker_ledger() is None and worker.ledger.accounts() == ()
        assert not os.path.exists(path)
        assert abs(report["freed_device_used"]) <= SLACK, report
    finally:
        print("vllm034 ExtensibleKVCache on the GPU:", report)
