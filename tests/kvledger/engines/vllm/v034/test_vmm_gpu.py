"""vLLM 0.34's own `ExtensibleTensor` on a real GPU (marker `gpu`), followed by kvledger's
patches on it: the reservation takes no device memory, every commit's granules are device
memory outside torch's allocator that kvledger reports as physical (and the worker's NVML
truth, `gpu_truth.WorkerTruth`, as `kv`, not `outside_torch`, with the model as `weights` and
nothing unattributed), release gives it back, free leaves nothing.

Needs vLLM 0.34's `vllm.utils.extensible_tensor` importable: on the device machine, the
dozen pure-Python vLLM files it imports, packed by `scripts/vllm034-vmm-subset`
(`scripts/gpu-check-vllm034` unpacks them and runs this). `ExtensibleKVCache` itself is not
built here (its module imports most of vLLM); the blocks are committed as its `commit` does
(`resize_segments_` with every segment's prefix, after `release_physical` for a shrink),
and the CPU tier (test_extensible.py) runs the class itself on a host-memory driver.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MIB = 1 << 20
LAYERS = 4  # segments: one per layer region, as for a layer-outermost layout
BLOCKS = 8192  # capacity
STRIDE = 32 * 1024  # bytes of one block in one layer


def _vllm_034() -> Any:
    et = pytest.importorskip("vllm.utils.extensible_tensor")
    import vllm

    if not str(vllm.__version__).startswith("0.34."):
        pytest.skip(f"vLLM {vllm.__version__} is not 0.34")
    return et


def test_vllm_extensible_tensor_on_cuda_followed_by_kvledger() -> None:
    et = _vllm_034()
    import torch
    from vllm.utils.vmm_driver import vmm_unavailable_reason

    from accounting.ledger import Ledger
    from kvledger.engines.vllm.extensible import CommitFollower, tensor_patches

    torch.cuda.init()
    reason = vmm_unavailable_reason()
    assert reason is None, f"vLLM says VMM is unusable here: {reason}"
    device = torch.device("cuda", 0)
    ledger = Ledger()
    freed: list[Any] = []

    def guard(what: str, fn: Any, *args: Any) -> None:
        fn(*args)  # a kvledger failure fails the test

    def on_free(follower: Any) -> None:
        freed.append(follower)
        follower.release(ledger)

    truth: Any = None  # gpu_truth.WorkerTruth, built after the first commit as the hook does
    patches = tensor_patches(guard, on_free)
    for p in patches:
        p.apply()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    # a model on the GPU, as the runner's (`runner.model`): the breakdown's weights
    runner = SimpleNamespace(model=torch.nn.Linear(1024, 1024).to(device))
    model_bytes = (1024 * 1024 + 1024) * 4
    try:
        # The kernels the test runs (zeroing new granules, fill_, a read back) loaded before
        # the baseline: a first launch loads its module, tens of MiB outside torch.
        warm = torch.ones(4, device=device)
        warm.zero_()
        warm.fill_(7)
        assert int(warm[-1].item()) == 7
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        torch0 = torch.cuda.memory_reserved()
        size = LAYERS * BLOCKS * STRIDE
        buf = et.ExtensibleTensor(
            size, device=device, segment_capacities=[BLOCKS * STRIDE] * LAYERS
        )
        granule = buf.granularity
        cache = SimpleNamespace(
            size=size, capacity_blocks=BLOCKS, bytes_per_block=LAYERS * STRIDE, buffer=buf
        )
        follower = CommitFollower(ledger, cache)

        def figures() -> dict[str, int]:
            torch.cuda.synchronize()
            snap = ledger.snapshot(reconcile=truth is not None)
            if truth is not None:
                [nv] = [r for r in snap.reconciliation if r["source"] == "nvml"]
                assert nv["available"], nv["reason"]
                # the committed granules are explained: growth since the baseline is ours
                assert abs(nv["unattributed_bytes"]) <= 8 * MIB, nv
            assert not [v for v in snap.violations if not v.subject.startswith("truth")], (
                snap.violations
            )
            [row] = [b for b in snap.buffers if b.spec.family == "kv_pool"]
            out = {
                "physical": row.physical_bytes,
                "reserved": row.spec.reserved_bytes,
                "device_used": free0 - torch.cuda.mem_get_info()[0],
                "torch_reserved": torch.cuda.memory_reserved() - torch0,
                "committed": follower.committed_blocks,
            }
            parts: list[dict[str, int]] = [
                r["parts"] for r in snap.reconciliation or () if r.get("parts")
            ]
            if parts:
                out["kv_part"] = parts[0]["kv"]
                out["outside_torch_part"] = parts[0]["outside_torch"]
                out["weights_part"] = parts[0]["weights"]
            return out

        def expect(blocks: int) -> dict[str, int]:
            f = figures()
            granules = -(-blocks * STRIDE // granule) * LAYERS if blocks else 0
            assert f["physical"] == buf.physical_bytes == granules * granule
            assert f["committed"] == blocks and f["reserved"] == buf.capacity_bytes
            assert f["torch_reserved"] == 0  # outside torch's caching allocator
            # The device's own count moved by the committed granules (the driver may add
            # page-table memory of its own: a few MiB at most).
            assert abs(f["device_used"] - f["physical"]) <= 8 * MIB, f
            if "kv_part" in f:
                assert f["kv_part"] == f["physical"]
                assert f["weights_part"] == model_bytes
            report[f"blocks={blocks}"] = f
            return f

        expect(0)  # reserved: no memory yet
        buf.resize_segments_([2000 * STRIDE] * LAYERS, zero_new=True)  # a commit of 2000
        expect(2000)
        # vLLM's hook registers the cache after its first commit and builds the worker's
        # NVML truth then (gpu_truth.WorkerTruth): the committed granules are its baseline.
        truth = _worker_truth(torch, ledger, runner, report)
        f = expect(2000)
        view = buf.segment_view(0)  # real device memory behind the committed prefix
        view.fill_(7)
        assert int(view[-1].item()) == 7 and view.numel() == 2000 * STRIDE
        buf.resize_segments_([6000 * STRIDE] * LAYERS, zero_new=True)  # warm-up grows it
        expect(6000)
        buf.release_physical()  # commit(500, shrink=True): unmap all, map the prefix
        buf.resize_segments_([500 * STRIDE] * LAYERS, zero_new=True)
        expect(500)
        pool = next(a for a in ledger.accounts() if a.family == "kv_pool")
        assert pool.pages_unmapped_total * granule == report["blocks=6000"]["physical"]
        buf.release_physical()  # sleep
        expect(0)
        buf.resize_segments_([500 * STRIDE] * LAYERS, zero_new=True)  # recommit
        expect(500)
        if "outside_torch_part" in f:
            report["outside_torch_growth"] = (
                report["blocks=500"]["outside_torch_part"]
                - (report["blocks=0"]["outside_torch_part"])
            )
            assert abs(report["outside_torch_growth"]) <= 8 * MIB, report
        if truth is not None:
            named = truth.rebaseline("after the test's commits")
            report["rebaseline_named"] = named
            assert named is not None and abs(named) <= 8 * MIB, report
            truth.close()
            truth.close()  # idempotent
            assert all(r["source"] != "nvml" for r in ledger.snapshot().reconciliation)
        buf.free()
        assert freed == [follower] and ledger.accounts() == ()
        torch.cuda.synchronize()
        report["after_free_device_used"] = free0 - torch.cuda.mem_get_info()[0]
        assert abs(report["after_free_device_used"]) <= 8 * MIB
    finally:
        for p in reversed(patches):
            p.remove()
        print("vllm034 VMM on the GPU:", report)


def _worker_truth(torch: Any, ledger: Any, runner: Any, report: dict[str, Any]) -> Any:
    """kvledger's vLLM worker truth (NVML, the GPU parts) where pynvml is here, else None."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        report["nvml"] = "pynvml missing: no GPU breakdown checked"
        return None
    from kvledger.engines.vllm.gpu_truth import WorkerTruth, cuda_index

    assert cuda_index({"layer.0": runner.model.weight}) == 0
    return WorkerTruth(ledger, runner, 0)
