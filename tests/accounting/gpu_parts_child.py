"""The GPU parts on a real GPU, step by step, in a process of its own (tests/accounting/
test_gpu_parts_gpu.py runs it): a small real torch model as the weights, runtime-owned KV
tensors, activations and the caching allocator's cached blocks, a captured CUDA graph, an
allocation outside torch (cuMemAlloc through cuda-bindings) and a second process holding
memory on the same GPU. Each step prints one JSON line: the truth reader's result and the
independent measures the parent holds every part against. Needs only torch, cuda-bindings,
nvidia-ml-py and kvledger's accounting package."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import pynvml
import torch
from cuda.bindings import driver

from accounting.buffers import runtime_buffer
from accounting.ledger import Ledger
from accounting.nvml import NvmlTruth
from accounting.torch_memory import cuda_torch_memory, weight_bytes

MiB = 1 << 20
DEV = torch.device("cuda:0")
VOCAB, HIDDEN, FFN = 8192, 1024, 4096
# by hand: the tied embedding / head once, the MLP's two weights and biases, the rope buffer
WEIGHTS = (VOCAB * HIDDEN + HIDDEN * FFN + FFN + FFN * HIDDEN + HIDDEN + 256 * 64) * 4
KV_LAYERS, KV_ROWS, KV_ROW = 4, 1024, 4096  # runtime-owned KV: 4 x 4 MiB


class TiedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, FFN)
        self.down = torch.nn.Linear(FFN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("rope", torch.zeros(256, 64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h)


SECOND = """
import sys, torch
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""


def check(rc: object, what: str) -> object:
    err = rc[0] if isinstance(rc, tuple) else rc
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err}")
    return rc[1] if isinstance(rc, tuple) and len(rc) > 1 else None


def _segments() -> list[tuple[int, int, str, int]]:
    """(address, size, pool id, stream) of every segment torch's caching allocator holds."""
    return [
        (s["address"], s["total_size"], str(s.get("segment_pool_id")), s["stream"])
        for s in torch.cuda.memory_snapshot()
    ]


def main() -> None:
    torch.ones(1, device=DEV).add_(1).item()  # the context and torch's first kernel
    model = TiedMLP().to(DEV).eval()
    kv = [torch.zeros(KV_ROWS, KV_ROW, dtype=torch.uint8, device=DEV) for _ in range(KV_LAYERS)]
    ledger = Ledger({"model_name": "gpu-parts", "tp_rank": "0"})
    ledger.add_account(
        [
            runtime_buffer(t, name=f"kv.{i}", family="kv", pool="kv", layer=i)
            for i, t in enumerate(kv)
        ]
    )
    torch.cuda.synchronize()
    truth = NvmlTruth(
        0, torch_memory=lambda: cuda_torch_memory(0), weights=lambda: weight_bytes([model], DEV)
    )
    ledger.add_truth(truth)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(truth.identity)

    def listed() -> dict[int, int]:
        return {
            int(p.pid): int(p.usedGpuMemory or 0)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        }

    def step(name: str, **measures: object) -> dict:
        torch.cuda.synchronize()
        snap = ledger.snapshot()
        r = next(x for x in snap.reconciliation if x["source"] == "nvml")
        out = {
            "step": name,
            "truth": r,
            "violations": [v.to_dict() for v in snap.violations],
            "reserved": torch.cuda.memory_reserved(0),
            "allocated": torch.cuda.memory_allocated(0),
            "listed": listed(),
            "pid": os.getpid(),
            **measures,
        }
        print(json.dumps(out, default=str), flush=True)
        return out

    step("baseline", weights=WEIGHTS, kv=sum(t.numel() for t in kv))

    x = torch.empty(64 * MiB, dtype=torch.uint8, device=DEV)
    step("activations", live=64 * MiB)
    del x
    step("slack", freed=64 * MiB)

    tokens = torch.randint(0, VOCAB, (8, 16), device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(tokens)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # The capture's stream gets a small-block segment of the default pool before the
    # measure: capture_begin allocates the generator's graph-safe seed and offset tensors
    # (a few bytes, outside the capture) on the capture stream, and the caching allocator
    # keeps blocks per stream, so without this they would open a 2 MiB segment of the
    # default pool during the capture (live bytes and slack, not the graph's pool) and the
    # reserved growth would over-count the pool by that segment.
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture):
        keep = torch.empty(1, device=DEV)
    # torch.cuda.graph() empties the cache on entry (gc.collect(); empty_cache()): do it
    # first, so that the growth of reserved bytes across the capture is the graph's pool
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(0)
    segments_before = _segments()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture), torch.no_grad():
        out = model(tokens)
    torch.cuda.synchronize()
    graph_pool = torch.cuda.memory_reserved(0) - before
    new_segments = sorted(set(_segments()) - set(segments_before))  # said, not asserted
    graph.replay()
    step(
        "graph",
        graph_pool=graph_pool,
        out_bytes=out.numel() * out.element_size(),
        new_segments=new_segments,
    )
    named = truth.rebaseline(ledger.snapshot(reconcile=False), "after CUDA graph capture")
    step("rebaselined", named=named)

    check(driver.cuInit(0), "cuInit")
    ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if not int(ctx):  # type: ignore[call-overload]  # torch's primary context, current here
        dev = check(driver.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
        ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    ptr = check(driver.cuMemAlloc(32 * MiB), "cuMemAlloc")
    step("cuMemAlloc", outside=32 * MiB)

    child = subprocess.Popen(
        [sys.executable, "-c", SECOND], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        step("second process", second_pid=child.pid, second_tensor=256 << 20)
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)
    time.sleep(1.0)
    step("second process gone")
    check(driver.cuMemFree(ptr), "cuMemFree")
    step("cuMemFree")
    del graph, out, keep
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    step("graph released")


if __name__ == "__main__":
    main()
