"""The GPU parts (accounting.gpu_parts) through the ledger, on the CPU: weights from a real
torch module (a tied embedding counted once), a CUDA-free stand-in for torch's graph pool,
kvledger's VMM pages on the host backend (its memfd the truth of what they hold), and NVML
at accounting.nvml's boundary (tests/accounting/nvml_standin.py, pynvml's own errors). Every
part matches the figure it is built to be, `unattributed` is 0 once every byte is named, and
a planted counting bug is a listed violation."""

from __future__ import annotations

import logging

import pynvml
import pytest
import torch

from accounting import gpu_parts, nvml
from accounting.gpu_parts import PART_NAMES
from accounting.snapfile.summary import summary_of
from accounting.torch_memory import torch_memory_of, weight_bytes
from tests.accounting.gpu_rig import (
    CONTEXT,
    OTHER,
    TIED_LM_BYTES,
    UNLISTED,
    MiB,
    Rig,
    TiedLM,
    gpu_rig,
)
from tests.accounting.nvml_standin import INDEX, UUID


@pytest.fixture
def rig(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """`request.param` (by indirect parametrisation) is passed to `gpu_rig`."""
    with gpu_rig(monkeypatch, **getattr(request, "param", {})) as r:
        yield r


def _memfd_truth(snap) -> int:
    return next(r for r in snap.reconciliation if r["source"] == "host_memfd")["device_bytes"]


def test_weights_count_each_storage_once() -> None:
    model = TiedLM()
    assert weight_bytes([model]) == TIED_LM_BYTES
    # a draft model sharing the target's embedding adds only its own storages
    draft = torch.nn.Linear(64, 64)
    draft.shared = model.embed  # the same Embedding module, so the same storage
    assert weight_bytes([model, draft]) == TIED_LM_BYTES + (64 * 64 + 64) * 4
    assert weight_bytes([model], device="cuda") == 0  # none of it on a GPU


def test_graph_and_arena_pools_are_told_apart_from_the_ordinary_pools() -> None:
    segs = [
        {"segment_pool_id": (0, 0), "total_size": 100, "allocated_size": 60},
        {"segment_pool_id": (2, 0), "total_size": 40, "allocated_size": 30},  # a graph's pool
        {"segment_pool_id": (0, 5), "total_size": 1000, "allocated_size": 900},  # a VMM arena
        {"segment_pool_id": (0, 6), "total_size": 8, "allocated_size": 8},  # a capture's pool=
    ]
    t = torch_memory_of(
        segs, reserved_bytes=1148, allocated_bytes=998, arena_pools=[(0, 5)], graph_pools=[(0, 6)]
    )
    assert (t.graph_reserved_bytes, t.graph_allocated_bytes) == (48, 38)
    assert (t.arena_reserved_bytes, t.arena_allocated_bytes) == (1000, 900)
    assert t.physical_bytes == 148 and t.ordinary_allocated_bytes == 60
    assert t.ordinary_reserved_bytes == 100


def test_every_part_matches_its_measure_and_nothing_is_unattributed(rig: Rig) -> None:
    sl = rig.sl
    r, snap = rig.parts()
    assert r["available"] and r["basis"] == "process"
    assert (r["uuid"], r["gpu"]) == (UUID, str(INDEX))
    p = r["parts"]
    assert list(p) == list(PART_NAMES)
    assert p["weights"] == TIED_LM_BYTES
    assert p["kv"] == snap.total("physical_bytes")
    assert p["outside_torch"] == CONTEXT
    assert p["other_processes"] == OTHER + UNLISTED
    assert p["unattributed"] == 0 and not snap.violations

    # KV pages mapped on the host backend: kv grows by what the memfd holds, nothing else moves
    sl.allocate(1500)
    r, snap = rig.parts()
    p = r["parts"]
    assert _memfd_truth(snap) > 0
    runtime = sum(b.physical_bytes for b in snap.buffers if b.spec.owner.value == "runtime")
    assert p["kv"] == _memfd_truth(snap) + runtime
    assert p["unattributed"] == 0 and not snap.violations

    # a captured graph's pool, activations and cached free blocks in the default pool
    rig.torch_mem.add((1, 0), 24 * MiB, 20 * MiB)
    rig.torch_mem.add((0, 0), 32 * MiB, 10 * MiB)
    r, snap = rig.parts()
    p = r["parts"]
    assert p["cuda_graphs"] == 24 * MiB
    assert p["activations"] == 10 * MiB
    default = [s for s in rig.torch_mem.segments if s["segment_pool_id"] == (0, 0)]
    assert p["allocator_slack"] == sum(s["total_size"] - s["allocated_size"] for s in default)
    assert p["unattributed"] == 0 and not snap.violations

    # memory taken outside torch (a library's cuMemAlloc) is outside_torch at once; the
    # reconciliation's own figure (growth since the last named point) shows it until named
    rig.outside[0] += 6 * MiB
    r, snap = rig.parts()
    assert r["parts"]["outside_torch"] == CONTEXT + 6 * MiB
    assert r["parts"]["unattributed"] == 0 and not snap.violations
    assert r["unattributed_bytes"] == 6 * MiB
    assert rig.truth.rebaseline(sl.ledger.snapshot(reconcile=False), "after the allocation")
    r, snap = rig.parts()
    assert r["parts"]["outside_torch"] == CONTEXT + 6 * MiB
    assert r["parts"]["unattributed"] == 0 == r["unattributed_bytes"] and not snap.violations

    # every publish: the device's parts add up to NVML's used, the process's to its figure
    d = r["detail"]
    assert sum(r["parts"].values()) == d["used_bytes"]
    mine = gpu_parts.process_total(r["parts"]) + r["parts"]["unattributed"]
    assert mine == d["process_used_bytes"]
    assert summary_of(snap).reconciliation[1].parts == r["parts"]


def test_a_weight_counted_per_tensor_is_a_listed_violation(rig: Rig) -> None:
    model = TiedLM()

    def per_tensor() -> int:  # the planted bug: the tied embedding counted twice
        return sum(p.nbytes for _, p in model.named_parameters(remove_duplicate=False)) + sum(
            b.nbytes for b in model.buffers()
        )

    rig.truth._weights = per_tensor
    _, snap = rig.parts()
    broken = {v.relation for v in snap.violations if v.subject == "truth nvml"}
    assert broken == {"activations >= 0"}, snap.violations


def test_a_part_left_out_of_the_sum_is_a_listed_violation(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.torch_mem.add((0, 0), 8 * MiB, 2 * MiB)
    good = gpu_parts.parts_of

    def forgets_slack(readings):  # the planted bug: a part dropped after the sum was taken
        p = good(readings)
        p["allocator_slack"] = 0
        return p

    monkeypatch.setattr(nvml, "parts_of", forgets_slack)
    _, snap = rig.parts()
    relations = {v.relation for v in snap.violations if v.subject == "truth nvml"}
    assert relations == {
        "sum of GPU parts == NVML device used",
        "process parts + unattributed == NVML process used",
    }


@pytest.mark.parametrize(
    "rig", [{"processes_error": pynvml.NVMLError_NoPermission()}], indirect=True
)
def test_no_per_process_figure_falls_back_to_device_wide_with_the_basis_named(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    r, snap = rig.parts()
    assert r["basis"] == "device"
    assert "NVMLError_NoPermission" in r["detail"]["process_figure"]
    # what the device held at the baseline beyond torch and the VMM pools is named
    assert r["parts"]["other_processes"] == CONTEXT + OTHER + UNLISTED
    assert r["parts"]["outside_torch"] == 0
    assert r["parts"]["unattributed"] == 0 and not snap.violations
    rig.sl.allocate(700)
    rig.torch_mem.add((0, 0), 4 * MiB, 4 * MiB)
    rig.outside[0] += 2 * MiB
    r, snap = rig.parts()
    assert r["parts"]["activations"] == 4 * MiB
    assert r["parts"]["kv"] == snap.total("physical_bytes")
    assert r["parts"]["unattributed"] == 2 * MiB  # growth outside torch, not yet named
    assert not snap.violations

    rig.standin.processes_error = None
    rig.standin.hide_pid = True  # a pid namespace: NVML lists the process under another pid
    truth = nvml.NvmlTruth(0, torch_memory=rig.torch_mem)
    assert truth.basis == "device" and "lists no process" in truth.process_reason


def test_a_gpu_that_disappears_is_one_log_line_and_truth_unavailable(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.standin.lost = pynvml.NVMLError_GpuIsLost()
    with caplog.at_level(logging.WARNING, logger="accounting.nvml"):
        for _ in range(5):
            r, snap = rig.parts()
            assert not r["available"] and "GpuIsLost" in r["reason"]
            assert r["parts"] == {} and not snap.violations
        assert rig.truth.rebaseline(snap, "while lost") is None
    lines = [rec for rec in caplog.records if "GpuIsLost" in rec.getMessage()]
    assert len(lines) == 1
    summary = summary_of(snap)
    assert [x.available for x in summary.reconciliation if x.source == "nvml"] == [False]
    rig.standin.lost = None
    r, _ = rig.parts()
    assert r["available"] and r["parts"]["unattributed"] == 0


def test_background_doc_carries_the_generated_parts_table() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "background.md").read_text()
    block = text.split("<!-- gpu-parts:begin -->\n", 1)[1].split("\n<!-- gpu-parts:end -->", 1)[0]
    assert block == gpu_parts.markdown_table()


def test_the_segment_walk_is_taken_again_only_when_segments_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CudaTorchMemory, with torch.cuda's three reads stood in for (no CUDA here)."""
    from accounting.torch_memory import CudaTorchMemory

    segs = [
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 20 * MiB, "allocated_size": 0},
        {"device": 0, "segment_pool_id": (3, 0), "total_size": 8 * MiB, "allocated_size": 6 * MiB},
        {"device": 1, "segment_pool_id": (0, 0), "total_size": 99 * MiB, "allocated_size": 0},
    ]
    allocated = [6 * MiB]
    walks = []

    def snapshot():
        walks.append(1)
        return [dict(s) for s in segs]

    def reserved(device=0):
        return sum(s["total_size"] for s in segs if s["device"] == device)

    def stats(device=0):
        return {
            "reserved_bytes.all.current": reserved(device),
            "allocated_bytes.all.current": allocated[0],
            "segment.all.current": sum(1 for s in segs if s["device"] == device),
        }

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "memory_reserved", reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=0: allocated[0])
    monkeypatch.setattr(torch.cuda, "memory_stats", stats)
    now = [0.0]
    read = CudaTorchMemory(0, max_age=10, clock=lambda: now[0])
    t = read()
    assert (t.reserved_bytes, t.graph_reserved_bytes, t.graph_allocated_bytes) == (
        28 * MiB,
        8 * MiB,
        6 * MiB,
    )
    allocated[0] += 5 * MiB  # an activation in a cached block: no segment moves
    t = read()
    assert len(walks) == 1 and t.allocated_bytes == 11 * MiB and t.graph_reserved_bytes == 8 * MiB
    segs.append(
        {"device": 0, "segment_pool_id": (3, 0), "total_size": 4 * MiB, "allocated_size": 4 * MiB}
    )
    allocated[0] += 4 * MiB
    assert read().graph_reserved_bytes == 12 * MiB and len(walks) == 2  # a segment made
    now[0] = 10.0
    read()
    assert len(walks) == 3  # and at most max_age apart


# -- parts held against the device's size: issue 43 finding 5 -------------------------------------
GiB = 1 << 30


def _parts(**values: int) -> dict[str, int]:
    return {**dict.fromkeys(PART_NAMES, 0), **values}


def test_a_part_past_the_devices_total_is_a_violation_even_without_nvmls_used_figure():
    """With no used_bytes the sum was not checked: 500 GiB of weights on an 80 GiB card, or
    an unattributed part of -1 TiB, went out as truth. Held against total_bytes now."""
    check = gpu_parts.check_parts
    lie = check(
        _parts(weights=500 * GiB),
        device_used=None,
        process_used=None,
        basis="device",
        total_bytes=80 * GiB,
    )
    assert [(v.relation, v.detail) for v in lie] == [
        (gpu_parts.PART_WITHIN_TOTAL, f"weights={500 * GiB}, total_bytes={80 * GiB}"),
        (gpu_parts.SUM_WITHIN_TOTAL, f"sum={500 * GiB}, total_bytes={80 * GiB}"),
    ]
    negative = check(
        _parts(weights=10 * GiB, unattributed=-(1 << 40)),
        device_used=None,
        process_used=None,
        basis="device",
        total_bytes=80 * GiB,
    )
    assert [v.detail for v in negative] == [f"unattributed={-(1 << 40)}, total_bytes={80 * GiB}"]
    fits = _parts(weights=10 * GiB, kv=20 * GiB, other_processes=GiB, unattributed=-GiB)
    assert (
        check(fits, device_used=None, process_used=None, basis="device", total_bytes=80 * GiB) == []
    )
    # Neither NVML's used figure nor the device's size: nothing bounds the parts.
    (unbounded,) = check(fits, device_used=None, process_used=None, basis="device")
    assert unbounded.relation == gpu_parts.PARTS_HELD
    assert check(fits, device_used=30 * GiB, process_used=None, basis="device") == []
