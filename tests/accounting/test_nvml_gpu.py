"""NVML reads the GPU this process's CUDA device really is (marker gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, torch, pynvml
from accounting import nvml
# The context and torch's first kernels belong to the process, not to what is measured.
torch.ones(1, device="cuda:0").add_(1).item()
torch.cuda.synchronize()
torch.cuda.empty_cache()
h = nvml.device_handle(0)
pynvml.nvmlInit()
by_index = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())]
read = nvml.nvml_truth(0, torch_reserved=lambda: torch.cuda.memory_reserved(0))
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
class Snap: buffers = ()
r = read(Snap())
print(json.dumps({"chosen": nvml.device_identity(h), "by_index": [str(u) for u in by_index],
                  "torch_uuid": str(torch.cuda.get_device_properties(0).uuid), "truth": r},
                 default=str))
"""


def _child(env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cuda0_is_the_gpu_nvml_reads_and_its_growth_is_this_process() -> None:
    got = _child({})
    print(json.dumps(got, indent=1))
    assert got["chosen"].removeprefix("GPU-") == got["torch_uuid"].removeprefix("GPU-")
    r = got["truth"]
    assert r["available"] and r["basis"] in ("process", "device")
    assert r["device_bytes"] >= 256 << 20  # the 256 MiB tensor, through torch's reserved bytes
    assert r["unattributed_bytes"] == 0


def test_cuda_visible_devices_1_reads_the_second_gpu() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (CUDA_VISIBLE_DEVICES=1 must name the second)")
    got = _child({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    print(json.dumps(got, indent=1))
    # NVML numbers GPUs in PCI order whatever CUDA_VISIBLE_DEVICES says: index 1 is the second.
    assert got["chosen"] == got["by_index"][1] != got["by_index"][0]
    assert got["truth"]["detail"]["nvml_uuid"] == got["by_index"][1]
