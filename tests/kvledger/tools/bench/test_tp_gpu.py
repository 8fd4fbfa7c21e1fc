"""`kvledger bench tp --backend cuda` on two GPUs: two TP ranks, one GPU each, keep their SWA
pools in step through real page maps and unmaps (the bench raises if a cycle does not map and
unmap exactly one page id, the coordinator if the ranks' page ids diverge)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.servers import repo_env

pytestmark = pytest.mark.gpu


def test_two_ranks_on_two_gpus_map_and_unmap_in_step() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    args = ["--backend", "cuda", "--layers", "8", "--cycles", "20", "--warmup", "2", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvledger", "bench", "tp", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=repo_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA backend (one GPU per rank" in proc.stdout
    import json

    data = json.loads(proc.stdout.splitlines()[-1])
    assert data["alone"]["pages_per_change"] == 1
    for rank in data["ranks"]:
        for pool in ("alone", "tp", "tp_ahead"):
            assert rank[pool]["alloc_map"] > 0 and rank[pool]["free_unmap"] > 0
