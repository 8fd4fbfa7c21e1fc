"""The SGLang plugin path on cuda:0 (markers gpu and sglang): SGLang's DeepSeek-V4 pool and SWA
allocator on the GPU, kvledger loaded by SGLang's `load_plugins()`, bridge off and on; what the
rank publishes reconciles with NVML's per-process figure with nothing unattributed.

Runs where SGLang 0.5.23 imports on CUDA (on the device machine: its wheels on PYTHONPATH and
the `sgl_kernel` stand-in). kvledger need not be installed: without its entry point in the
environment, the child gets a dist-info folder written from pyproject.toml (`dist`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kvledger.engines.sglang.plugin.test_plugin import Proc, _env

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

PAGE = 256
PIECES = """SGLang pieces that ran for real in the child:
  sglang.srt.plugins.load_plugins (entry-point discovery) and HookRegistry.apply_hooks
  runtime context published as a scheduler's (served model name, ranks)
  DeepSeekV4TokenToKVPool on {device}, ReqToTokenPool, SWATokenToKVPoolAllocator
  SWATokenToKVPoolAllocator.alloc_extend / free on {device} (its device kernels)
  ModelRunner._init_post_memory_pool_components (hooked; on a runner without a model),
    with SGLang's KVIndexTranslator, canary and capturer set-up after kvledger's hook
  Scheduler.release_host_resources (hooked; on a scheduler without __init__)
Not SGLang's: the CUDA graph is a torch capture of one op, and kvledger's after-capture
hook is called directly (ModelRunner.init_cuda_graphs needs a model)."""


def _nvml(answer: dict) -> dict:
    (r,) = [r for r in answer["reconciliation"] if r["source"] == "nvml"]
    return r


def _show(step: str, answer: dict) -> None:
    r = _nvml(answer)
    d = r["detail"]
    print(
        f"{step:>22}: basis={r['basis']} device_bytes={r['device_bytes']} "
        f"ledger_bytes={r['ledger_bytes']} unattributed={r['unattributed_bytes']} "
        f"| vmm={d['vmm_physical_bytes']} torch_reserved={d['torch_reserved_bytes']} "
        f"torch_kv={d['torch_kv_bytes']} torch_non_kv={d['torch_non_kv_bytes']} "
        f"outside_torch={d['outside_torch_bytes']} process_used={d['process_used_bytes']} "
        f"used={d['used_bytes']} | headline_bytes={answer['totals']['physical_bytes']}"
    )


@pytest.mark.parametrize("bridge", ["0", "1"], ids=["native", "bridged"])
def test_plugin_path_on_cuda_reconciles_with_nvml_per_process(tmp_path: Path, bridge: str) -> None:
    snap = tmp_path / "snap"
    snap.mkdir(mode=0o700)
    env = _env(
        KVLEDGER_SGLANG="1",
        KVLEDGER_SGLANG_DSV4_BRIDGE=bridge,
        KVLEDGER_SGLANG_REQUIRE="1",  # a kvledger failure fails the test, not a log line
        KVLEDGER_SNAPSHOT_DIR=str(snap),
    )
    args = ("--build", "--device", "cuda", "--swa-pages", "64", "--full-pages", "80")
    proc = Proc(env, *args)
    try:
        first = proc.first
        print(PIECES.format(device="cuda"))
        print(f"labels={first['labels']} bridged={first['bridged']} {first['reason']}")
        assert first["bridged"] is (bridge == "1"), first["reason"]
        assert Path(first["file"]).exists()

        # The shapes served below, once before the re-baseline: their kernels get loaded.
        warm = proc.send(f"warm {40 * PAGE} {10 * PAGE}")
        _show("after warm + capture", warm)
        r = _nvml(warm)
        assert r["available"], r["reason"]
        assert r["basis"] == "process", "NVML did not list this process: device-wide truth used"
        assert r["unattributed_bytes"] == 0
        idle = warm["totals"]["physical_bytes"]
        if bridge == "0":
            # A native pool: the headline is its tensor bytes, every storage it holds.
            assert idle == warm["totals"]["tensor_bytes"] == first["storages"]

        for step in (f"prefill {40 * PAGE}", f"prefill {10 * PAGE}", "finish"):
            answer = proc.send(step)
            _show(step, answer)
            assert _nvml(answer)["unattributed_bytes"] == 0, step
            parts = _nvml(answer)["parts"]
            print(
                f"{'':>22}  parts (MiB): "
                + ", ".join(f"{k}={v / 2**20:.1f}" for k, v in parts.items())
            )
            assert parts["unattributed"] == 0 and min(parts.values()) >= 0, (step, parts)
            assert sum(parts.values()) == _nvml(answer)["detail"]["used_bytes"], step
            # SGLang's own figure is kvledger's, in SGLang's GB
            assert answer["mem_usage"] == answer["totals"]["physical_bytes"] / 2**30, step
            if step.startswith("prefill") and bridge == "1":
                # SGLang's rows now sit on VMM pages: occupancy moved, and physical bytes never
                # fell below idle (map-ahead may have mapped the rows before SGLang took them).
                assert answer["totals"]["occupied_slots"] > warm["totals"]["occupied_slots"]
                assert answer["totals"]["physical_bytes"] >= idle
            if bridge == "0":
                assert answer["totals"]["physical_bytes"] == idle

        out = proc.send("exit")
        assert out == {"file_exists": False, "rank": True}
        proc.send("quit", answer=False)
        assert proc.wait() == 0
    finally:
        proc.close()
        if proc.stderr:
            print(proc.stderr[-3000:])
