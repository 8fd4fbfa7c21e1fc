"""The plugin: its entry point, the patched worker and scheduler paths, the published files
read back by the exporter's reader, and release (files gone, vLLM's methods restored)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from exporter.sources import Sources
from kvledger.engines.vllm import hooks
from tests.kvledger.engines.vllm import vllm_setup as vs

ROOT = Path(__file__).resolve().parents[4]


def test_the_entry_point_off_imports_nothing_more() -> None:
    code = (
        "import sys, kvledger.engines.vllm as p; p.register(); p.register(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('kvledger', 'accounting', 'allocator', 'exporter', 'torch', 'vllm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        out.stdout.strip()
        == "['accounting', 'accounting.switches', 'kvledger', 'kvledger.engines', 'kvledger.engines.vllm', 'kvledger.engines.vllm.switches']"
    )


def test_a_malformed_switch_is_named() -> None:
    from kvledger.engines.vllm import env_switch

    with pytest.raises(ValueError, match="KVLEDGER_VLLM='maybe'"):
        env_switch("KVLEDGER_VLLM", {"KVLEDGER_VLLM": "maybe"})


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_plugin_and_it_patches_once() -> None:
    """vLLM's own loader finds the entry point; on, the targets are kvledger's wrappers,
    twice is once, and uninstall gives vLLM its methods back."""
    code = """
import os
from vllm.plugins import load_general_plugins
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R
from vllm.v1.core.sched.scheduler import Scheduler as S
from vllm.v1.worker.gpu_worker import Worker as W
orig = (R.initialize_kv_cache_tensors, S.__init__, S.schedule, S.shutdown, W.compile_or_warm_up_model)
load_general_plugins()
from kvledger.engines.vllm import hooks, register
from kvledger.engines.vllm.patch import is_patched
assert all(is_patched(c, n) for c, n in [(R, "initialize_kv_cache_tensors"), (S, "__init__"), (S, "schedule"), (S, "shutdown"), (W, "compile_or_warm_up_model")])
first = R.initialize_kv_cache_tensors
register()
assert R.initialize_kv_cache_tensors is first
hooks.uninstall()
assert (R.initialize_kv_cache_tensors, S.__init__, S.schedule, S.shutdown, W.compile_or_warm_up_model) == orig
print("ok")
"""
    env = {**os.environ, "KVLEDGER_VLLM": "1", "VLLM_PLUGINS": "kvledger"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


_runner = vs.runner


@pytest.fixture
def snapdir(tmp_path, monkeypatch):
    d = tmp_path / "snap"
    monkeypatch.setenv("KVLEDGER_SNAPSHOT_DIR", str(d))
    monkeypatch.setenv("KVLEDGER_PUBLISH_INTERVAL", "0.05")
    monkeypatch.delenv("KVLEDGER_VLLM_REQUIRE", raising=False)
    yield d
    hooks.uninstall()


@pytest.mark.vllm
def test_worker_and_scheduler_publish_what_serve_reads(snapdir) -> None:
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tests.kvledger.engines.vllm.test_occupancy import _manager, _request, _run

    original = GPUModelRunner.initialize_kv_cache_tensors
    cfg = vs.vllm_config(served_model_name=["tiny"])
    specs = {**vs.full_specs(4), **vs.sliding_specs(4)}
    config = vs.kv_cache_config(cfg, specs, 8 << 20)
    assert hooks.install()
    runner = _runner(cfg, config)
    kv = GPUModelRunner.initialize_kv_cache_tensors(runner, config, None)
    storage = next(iter(kv.values())).untyped_storage().nbytes()
    assert all(isinstance(t, torch.Tensor) for t in kv.values()) and len(runner.kv_caches) == 8
    worker = hooks.worker_ledger()
    assert worker is not None
    # a cache on the CPU gets no NVML truth (gpu_truth; on CUDA: test_vmm_gpu.py)
    from kvledger.engines.vllm.gpu_truth import WorkerTruth

    assert not [p for p in worker.parts if isinstance(p, WorkerTruth)]
    hooks._rebaseline_worker("after warm-up")  # what the warm-up hook calls: nothing to do

    # The engine core: the patched __init__'s work on a scheduler with a real manager.
    manager = _manager(config)
    sched = SimpleNamespace(vllm_config=cfg, kv_cache_manager=manager, running=[])
    hooks._add_scheduler(sched)
    engine = hooks.scheduler_ledger()
    a = _request("a", list(range(100)))
    _run(a, manager)
    sched.running.append(a)  # Scheduler.running: read for the footprints at each refresh
    # The patched schedule publishes when due, on the scheduler's thread.
    schedule = hooks._wrap_schedule(lambda self: "out")
    import time

    time.sleep(0.06)
    assert schedule(sched) == "out"
    # The snapshot was taken there, after the refresh; the publisher's thread writes it.
    assert engine.handoff and engine.publisher.submitted >= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        last = engine.publisher.last_snapshot
        if last is not None and last.request_slots and last.request_slots.running_requests:
            break
        time.sleep(0.005)

    with Sources(snapdir) as sources:
        views = {v.labels["engine_type"]: v for v in sources.read().views}
    assert set(views) == {"vllm_worker", "vllm_scheduler"}
    assert all(v.up for v in views.values()), [v.stale_reason for v in views.values()]
    w, s = views["vllm_worker"], views["vllm_scheduler"]
    assert w.labels["model_name"] == s.labels["model_name"] == "tiny"
    assert w.labels["engine"] == s.labels["engine"] == "0"
    assert (w.labels["tp_rank"], w.labels["pp_rank"]) == ("0", "0")
    assert w.summary.totals.physical_bytes == storage
    fams = {f.family: f.figures for f in s.summary.families}
    used = manager.block_pool.num_gpu_blocks - manager.block_pool.get_num_free_blocks()
    assert fams["kv_pool"].occupied_slots == used
    g0 = next(f for name, f in fams.items() if name.startswith("g0_"))
    assert g0.occupied_slots == 7 * vs.BLOCK  # 100 tokens: 7 blocks of 16
    part = s.summary.request_slots
    assert part is not None and part.running_requests == 1
    assert part.requests[0].rid == "a" and part.requests[0].tokens == 100
    assert part.families[0].slots_sum == 7 * vs.BLOCK
    kinds = [vs.kind_of(g.kv_cache_spec) for g in config.kv_cache_groups]
    assert {f.family for f in w.summary.families} == {"kv_pool"} | {
        f"g{i}_{k}" for i, k in enumerate(kinds)
    }

    # Release: scheduler shutdown removes its file; uninstall removes the worker's and
    # restores vLLM's method.
    paths = [worker.publisher.path, engine.publisher.path]
    assert all(os.path.exists(p) for p in paths)
    hooks._close_scheduler(sched)
    assert not os.path.exists(paths[1])
    hooks.uninstall()
    assert not os.path.exists(paths[0])
    assert GPUModelRunner.initialize_kv_cache_tensors is original
    assert Scheduler.schedule.__name__ == "schedule" and not hasattr(
        Scheduler.schedule, "__kvledger_original__"
    )


@pytest.mark.vllm
def test_a_failure_is_one_line_and_vllm_carries_on(snapdir, caplog, tmp_path, monkeypatch) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bad = tmp_path / "not-a-dir"
    bad.write_text("")
    monkeypatch.setenv("KVLEDGER_SNAPSHOT_DIR", str(bad / "x"))
    cfg = vs.vllm_config()
    config = vs.kv_cache_config(cfg, vs.full_specs(2), 2 << 20)
    hooks.install()
    kv = GPUModelRunner.initialize_kv_cache_tensors(_runner(cfg, config), config, None)
    assert len(kv) == 2  # vLLM got its tensors
    assert hooks.worker_ledger() is None
    assert "kvledger is off in this process" in caplog.text
    monkeypatch.setenv("KVLEDGER_VLLM_REQUIRE", "1")
    hooks.uninstall()
    hooks.install()
    with pytest.raises(OSError):
        GPUModelRunner.initialize_kv_cache_tensors(_runner(cfg, config), config, None)
