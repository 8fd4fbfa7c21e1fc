"""A vLLM worker's GPU breakdown (kvledger.engines.vllm.gpu_truth) on the CPU: the worker's
NVML truth built after its cache as the hook builds it, NVML as tests/accounting's stand-in
(pynvml's own errors), torch's allocator as a list of segments, a real torch model as the
runner's. The same reader on a real GPU beside vLLM 0.34's extensible cache:
tests/kvledger/engines/vllm/v034/test_vmm_gpu.py."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from accounting import nvml
from accounting.torch_memory import weight_bytes
from kvledger.engines.vllm.gpu_truth import WorkerTruth, cuda_index, graph_pools
from tests.accounting.gpu_rig import (
    CONTEXT,
    OTHER,
    OTHER_PID,
    TIED_LM_BYTES,
    MiB,
    TiedLM,
    TorchStandIn,
)
from tests.accounting.nvml_standin import NvmlStandIn, install
from tests.ledgers import small_ledger


@contextlib.contextmanager
def worker(monkeypatch: Any) -> Iterator[tuple[Any, WorkerTruth, list[int], TorchStandIn]]:
    """A worker ledger with its cache (VMM pages and runtime-owned KV tensors), then its
    truth, as `hooks._add_worker_cache` builds them."""
    runner = SimpleNamespace(model=TiedLM())
    torch_mem = TorchStandIn()
    outside = [CONTEXT]
    with small_ledger() as sl:
        sl.allocate(300)  # pages mapped before the truth: its baseline
        runtime_kv = nvml.runtime_physical_bytes(sl.ledger.snapshot(reconcile=False))
        torch_mem.add((0, 0), 64 * MiB, weight_bytes([runner.model]) + runtime_kv)
        install(
            monkeypatch,
            NvmlStandIn(
                pid=os.getpid(),
                process_used=lambda: (
                    outside[0] + torch_mem.physical() + sl.backend.physical_bytes()
                ),
                others=lambda: {OTHER_PID: OTHER},
            ),
        )
        wt = WorkerTruth(sl.ledger, runner, 0, torch_memory=torch_mem, weights_device="cpu")
        try:
            yield sl, wt, outside, torch_mem
        finally:
            wt.close()


def nvml_row(sl: Any) -> tuple[dict[str, Any], Any]:
    snap = sl.ledger.snapshot()
    [row] = [r for r in snap.reconciliation if r["source"] == "nvml"]
    return row, snap


def test_the_workers_parts_name_weights_kv_and_the_rest(monkeypatch) -> None:
    with worker(monkeypatch) as (sl, wt, _outside, torch_mem):
        row, snap = nvml_row(sl)
        assert row["available"] and row["basis"] == "process"
        parts = row["parts"]
        assert parts["weights"] == wt.weights_bytes == TIED_LM_BYTES
        assert parts["kv"] == snap.total("physical_bytes") > 0
        assert parts["outside_torch"] == CONTEXT  # the VMM pages are kv, not outside torch
        assert parts["other_processes"] == OTHER
        assert parts["unattributed"] == 0 and row["unattributed_bytes"] == 0
        assert not [v for v in snap.violations if v.subject.startswith("truth")]
        # growth after the baseline: pages mapped, a torch segment; both explained
        sl.allocate(900)
        torch_mem.add((0, 0), 20 * MiB, 0)
        row, snap = nvml_row(sl)
        assert row["unattributed_bytes"] == 0
        assert row["parts"]["kv"] == snap.total("physical_bytes")
        assert row["parts"]["allocator_slack"] >= 20 * MiB


def test_warm_up_memory_is_unattributed_until_the_rebaseline_names_it(monkeypatch) -> None:
    with worker(monkeypatch) as (sl, wt, outside, _torch_mem):
        outside[0] += 72 * MiB  # graph capture's executable graphs, kernel modules
        row, _ = nvml_row(sl)
        assert row["unattributed_bytes"] == 72 * MiB
        assert wt.rebaseline("after warm-up", sync=False) == 72 * MiB
        row, _ = nvml_row(sl)
        assert row["unattributed_bytes"] == 0
        assert row["detail"]["rebaselined_at"] == "after warm-up"
        assert row["parts"]["outside_torch"] == CONTEXT + 72 * MiB


def test_close_takes_the_truth_out_of_the_ledger_once(monkeypatch) -> None:
    with worker(monkeypatch) as (sl, wt, _outside, _torch_mem):
        wt.close()
        wt.close()
        assert wt.closed
        assert all(r["source"] != "nvml" for r in sl.ledger.snapshot().reconciliation)
        assert wt.rebaseline("late", sync=False) is None
        assert sl.ledger.remove_truth(wt.truth) is False


def test_without_nvml_the_worker_carries_on_with_the_reason(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    monkeypatch.setattr(nvml, "_initialised", False)
    runner = SimpleNamespace(model=None)
    with small_ledger() as sl:
        with WorkerTruth(sl.ledger, runner, 0, torch_memory=TorchStandIn()) as wt:
            row, _ = nvml_row(sl)
            assert not row["available"] and "NVML unavailable" in row["reason"]
            assert wt.weights_bytes == 0 and wt.rebaseline("x", sync=False) is None
        assert wt.closed


def test_a_model_torch_cannot_walk_is_one_warning_and_no_weights(monkeypatch, caplog) -> None:
    class Odd:
        def parameters(self) -> Any:
            raise RuntimeError("meta device")

    install(monkeypatch, NvmlStandIn(pid=os.getpid(), process_used=lambda: CONTEXT))
    runner = SimpleNamespace(model=Odd())
    with (
        small_ledger() as sl,
        caplog.at_level(logging.WARNING),
        WorkerTruth(sl.ledger, runner, 0, torch_memory=TorchStandIn()),
    ):
        pass
    assert [r.getMessage() for r in caplog.records] == [
        "kvledger: counting the vLLM model's weights failed: RuntimeError: meta device"
    ]


def test_cuda_index_is_none_off_cuda_and_the_ordinal_on_it() -> None:
    import torch

    assert cuda_index({"model.layers.0.attn": torch.zeros(2)}) is None
    assert cuda_index({}) is None
    on_gpu = SimpleNamespace(device=SimpleNamespace(type="cuda", index=2))
    assert cuda_index({"a": torch.zeros(1), "b": on_gpu}) == 2


@pytest.mark.parametrize(("handle", "want"), [((0, 5), [(0, 5)]), (None, []), ("not a pool", [])])
def test_vllms_graph_pool_is_read_without_being_made(monkeypatch, handle, want) -> None:
    made = []

    class Platform:
        _global_graph_pool = handle

        def get_global_graph_pool(self) -> Any:  # vLLM's: would make one
            made.append(1)

    module = types.ModuleType("vllm.platforms")
    module.current_platform = Platform()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", module)
    assert graph_pools() == want and made == []


def test_no_vllm_platform_means_no_named_graph_pool(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)
    assert graph_pools() == []
