"""On a GPU kept busy by another process: a page store's close unmaps pages still in use only
after the device work queued on them has run (issue 23: `Bridge.detach()` queued its
copy-back and closed the store, and on a busy H200 the copy read unmapped pages,
`cudaErrorIllegalAddress`). The store runs in a child process (a fault kills its CUDA
context), beside a hog child running bf16 matmuls.

    .venv/bin/python -m pytest tests/allocator/test_cuda_busy_unmap.py -q -m gpu -rP
    # what it catches, without the store's drain (expect an error or wrong bytes):
    python -m tests.allocator.cuda_busy_probe close --no-drain --rounds 10
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.allocator.cuda_busy_probe"


def test_close_beside_a_gpu_hog_unmaps_after_the_queued_copy_back() -> None:
    hog = subprocess.Popen(
        [sys.executable, "-m", PROBE, "hog", "120"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "hog ready"
        run = subprocess.run(
            [sys.executable, "-m", PROBE, "close", "--rounds", "20"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert hog.poll() is None, "the hog stopped before the probe ended"
    finally:
        hog.kill()
        hog.wait()
    print(run.stdout, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"rounds": 20, "wanted": 20, "wrong_bytes": 0, "error": "", "drain": True}
