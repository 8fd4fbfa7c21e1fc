"""A ledger whose NVML truth splits the GPU into parts, all on the CPU: tests/ledgers.py's
small ledger (kvledger's VMM pages on the host backend, runtime-owned KV tensors), a real
torch model as the weights, torch's caching allocator as a list of segments, and NVML
as tests/accounting/nvml_standin.py (pynvml's own errors)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accounting import nvml
from accounting.gpu_parts import TorchMemory
from accounting.torch_memory import torch_memory_of, weight_bytes
from tests.accounting.nvml_standin import NvmlStandIn, install
from tests.ledgers import SmallLedger, small_ledger

MiB = 1 << 20
CONTEXT = 500 * MiB  # the CUDA context and modules, held before the baseline
OTHER_PID, OTHER = 777, 3 << 30
UNLISTED = 9 * MiB  # driver memory NVML charges to no process


class TiedLM(torch.nn.Module):
    """A small real model: the output layer shares the embedding's weight (one storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.mlp = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 256, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("rope", torch.zeros(128, 32))


# Bytes of TiedLM's storages, counted by hand: embedding (= head), mlp weight and bias, rope.
TIED_LM_BYTES = (256 * 64 + 64 * 64 + 64 + 128 * 32) * 4


@dataclass
class TorchStandIn:
    """torch's caching allocator without CUDA: segments per pool as torch.cuda.memory_snapshot()
    lists them (`segment_pool_id`, `total_size`, `allocated_size`)."""

    segments: list[dict] = field(default_factory=list)

    def add(self, pool: tuple[int, int], total: int, allocated: int) -> None:
        self.segments.append(
            {"segment_pool_id": pool, "total_size": total, "allocated_size": allocated}
        )

    def __call__(self) -> TorchMemory:
        return torch_memory_of(
            self.segments,
            reserved_bytes=sum(s["total_size"] for s in self.segments),
            allocated_bytes=sum(s["allocated_size"] for s in self.segments),
        )

    def physical(self) -> int:
        return self().physical_bytes


@dataclass
class Rig:
    sl: SmallLedger
    torch_mem: TorchStandIn
    standin: NvmlStandIn
    truth: nvml.NvmlTruth
    outside: list[int]

    def parts(self) -> tuple[dict[str, Any], Any]:
        snap = self.sl.ledger.snapshot()
        r = next(r for r in snap.reconciliation if r["source"] == "nvml")
        return r, snap


@contextlib.contextmanager
def gpu_rig(monkeypatch: Any, *, processes_error: BaseException | None = None) -> Iterator[Rig]:
    """The rig, closed on exit; `processes_error` is raised by NVML's process list from
    before the baseline on."""
    model = TiedLM()
    torch_mem = TorchStandIn()
    outside = [CONTEXT]  # this process's bytes outside torch and the VMM pools
    with small_ledger() as sl:
        runtime_kv = nvml.runtime_physical_bytes(sl.ledger.snapshot(reconcile=False))
        # the runtime-owned KV tensors and the weights sit in torch's default pool
        torch_mem.add((0, 0), 64 * MiB, weight_bytes([model]) + runtime_kv)

        def process_used() -> int:
            return outside[0] + torch_mem.physical() + sl.backend.physical_bytes()

        standin = install(
            monkeypatch,
            NvmlStandIn(
                pid=os.getpid(),
                process_used=process_used,
                others=lambda: {OTHER_PID: OTHER},
                unlisted=UNLISTED,
            ),
        )
        standin.processes_error = processes_error
        truth = nvml.NvmlTruth(
            0,
            torch_memory=torch_mem,
            weights=lambda: weight_bytes([model]),
            vmm_at_baseline=sl.backend.physical_bytes(),  # the pool's pages made before it
        )
        sl.ledger.add_truth(truth)
        yield Rig(sl, torch_mem, standin, truth, outside)
