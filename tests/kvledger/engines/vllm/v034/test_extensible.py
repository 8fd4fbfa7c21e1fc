"""vLLM 0.34 on its own classes (marker `vllm034`, .venv-vllm034): the V2 runner is hooked,
the extensible (VMM) KV cache is read from vLLM's `ExtensibleKVCache` / `ExtensibleTensor`
as they commit, shrink, release and recommit blocks on a host-memory VMM driver
(`host_vmm`), and everything goes when vLLM frees the cache."""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any

import pytest

from accounting.buffers import Owner
from exporter.sources import Sources
from kvledger.engines.vllm import compat, hooks
from kvledger.engines.vllm.patch import MARK, is_patched
from tests.kvledger.engines.vllm import vllm_setup as vs
from tests.kvledger.engines.vllm.v034 import runner_v2
from tests.kvledger.engines.vllm.v034.host_vmm import GRANULE, host_vmm

pytestmark = pytest.mark.vllm034

MIB = 1 << 20


@pytest.fixture
def snapdir(tmp_path, monkeypatch):
    d = tmp_path / "snap"
    monkeypatch.setenv("KVLEDGER_SNAPSHOT_DIR", str(d))
    monkeypatch.setenv("KVLEDGER_PUBLISH_INTERVAL", "0.05")
    monkeypatch.delenv("KVLEDGER_VLLM_REQUIRE", raising=False)
    yield d
    hooks.uninstall()


@pytest.fixture
def v2(monkeypatch):
    """vLLM's V2 runner class with its KV part (runner_v2) in place of the whole method."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    monkeypatch.setattr(GPUModelRunner, "initialize_kv_cache", runner_v2.initialize_kv_cache)
    return GPUModelRunner


def _ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("kvledger")]


# -- which hook --------------------------------------------------------------------------
def test_vllm_0_34_hooks_the_v2_runner_and_the_extensible_tensor(snapdir, caplog) -> None:
    import vllm
    from vllm.utils.extensible_tensor import ExtensibleTensor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert vllm.__version__.startswith("0.34.")
    why: list[str] = []
    assert [h.name for h in compat.worker_hooks(why)] == ["v2"]
    assert why == ["vllm.v1.worker.gpu_model_runner.GPUModelRunner (ModuleNotFoundError)"]
    original = GPUModelRunner.initialize_kv_cache
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        assert compat.check() == ""
        targets = {p.target for p in hooks.install()}
    assert _ours(caplog) == []  # a tested version: no warning
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache" in targets
    assert is_patched(GPUModelRunner, "initialize_kv_cache")
    assert getattr(GPUModelRunner.initialize_kv_cache, MARK) is original  # vLLM's own, wrapped
    for name in ("resize_segments_", "release_physical", "free"):
        assert is_patched(ExtensibleTensor, name)
    hooks.uninstall()
    assert GPUModelRunner.initialize_kv_cache is original
    assert not any(
        is_patched(ExtensibleTensor, n) for n in ("resize_segments_", "release_physical", "free")
    )


def test_a_v1_runner_is_hooked_where_vllm_has_one(snapdir, monkeypatch) -> None:
    """A vLLM that still has the V1 runner (0.32, 0.33): its initialize_kv_cache_tensors is
    hooked, beside the V2 runner where that fits too."""

    class GPUModelRunner:
        def initialize_kv_cache_tensors(self, kv_cache_config: Any, kernel_block_sizes: Any):
            return {}

    module = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    module.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert [h.name for h in compat.worker_hooks()] == ["v1", "v2"]
    targets = {p.target for p in hooks.install()}
    assert is_patched(GPUModelRunner, "initialize_kv_cache_tensors")
    assert any(t.endswith("gpu.model_runner.GPUModelRunner.initialize_kv_cache") for t in targets)


def test_a_vllm_with_neither_hook_is_refused_in_one_line(snapdir, monkeypatch, caplog) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "initialize_kv_cache")
    why = compat.check()
    assert "\n" not in why and why.endswith("kvledger is off")
    assert why.startswith("vLLM 0.34.0: kvledger reads the KV classes of vLLM 0.32, 0.33, 0.34")
    assert (
        "neither the V1 runner's initialize_kv_cache_tensors nor the V2 runner's "
        "initialize_kv_cache fits" in why
    )
    assert "V2 GPUModelRunner.initialize_kv_cache" in why
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        assert hooks.install() == []
    assert _ours(caplog) == [f"kvledger: {why}"]
    monkeypatch.setenv("KVLEDGER_VLLM_REQUIRE", "1")
    with pytest.raises(RuntimeError, match="neither the V1 runner"):
        hooks.install()


def test_a_v2_runner_that_keeps_no_layer_views_is_not_hooked(monkeypatch) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False):  # 0.32's V2: no dict
        self.kv_cache_config = kv_cache_config
        self.kv_caches = []

    monkeypatch.setattr(GPUModelRunner, "initialize_kv_cache", initialize_kv_cache)
    why = compat.check()
    assert "V2 GPUModelRunner.kv_caches_by_layer (set by initialize_kv_cache)" in why


def test_an_extensible_cache_kvledger_cannot_read_is_named(monkeypatch) -> None:
    from vllm.utils.extensible_tensor import ExtensibleTensor

    monkeypatch.delattr(ExtensibleTensor, "num_bytes")
    why = compat.check()
    assert "ExtensibleTensor.num_bytes" in why and why.endswith("kvledger is off")


def test_another_version_whose_classes_fit_is_accepted_with_one_warning(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.1")
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        assert compat.check() == ""
    [message] = _ours(caplog)
    assert "vLLM 0.35.1 is none of 0.32, 0.33, 0.34" in message


# -- the extensible cache's figures --------------------------------------------------------
def _figures(worker: Any) -> dict[str, Any]:
    snap = worker.ledger.snapshot(reconcile=False)
    assert not snap.violations, snap.violations
    accounts = {a.family: a for a in snap.accounts}
    [pool] = [b for b in snap.buffers if b.spec.family == "kv_pool"]
    return {
        "snap": snap,
        "tensor": pool.spec.tensor_bytes,
        "reserved": pool.spec.reserved_bytes,
        "physical": pool.physical_bytes,
        "mapped": pool.mapped_bytes,
        "owner": pool.spec.owner,
        "committed": accounts["kv_pool_committed"].occupied_slots,
        "pool": accounts["kv_pool"],
    }


def _setup(monkeypatch, v2, layout: str = "LBNHC", memory: int = 121 * MIB // 2):
    """A hybrid model's worker (4 full-attention and 4 sliding-window layers: two groups)
    with vLLM's own KVCacheConfig, padded as the worker pads it for the extensible cache.
    LBNHC (layer-outermost, FlashAttention's first choice): one segment per layer region;
    BLNHC (block-outermost): one segment over the whole allocation."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    cfg = runner_v2.vllm_config(served_model_name=["tiny"])
    specs = {**vs.full_specs(4), **vs.sliding_specs(4)}
    resolve_kv_cache_layout(cfg, [[layout]], list(specs.values()))  # recorded on cfg
    config = runner_v2.padded(cfg, vs.kv_cache_config(cfg, specs, memory), GRANULE)
    runner = runner_v2.runner(cfg, config, "cuda:0")
    return cfg, config, runner


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_physical_follows_commit_shrink_release_recommit_and_free(
    snapdir, monkeypatch, v2, layout
) -> None:
    from vllm.v1.worker.extensible_kv_cache import ensure_kv_cache_blocks

    with host_vmm(monkeypatch) as driver:
        _, config, runner = _setup(monkeypatch, v2, layout)
        assert hooks.install()
        v2.initialize_kv_cache(runner, config, extensible=True)
        cache = runner.extensible_kv_cache
        worker = hooks.worker_ledger()
        assert worker is not None and cache is not None
        f = _figures(worker)
        # What vLLM holds, read from its own objects; the driver's books agree.
        assert f["owner"] is Owner.VMM
        assert f["tensor"] == cache.size
        assert (
            f["reserved"]
            == cache.buffer.capacity_bytes
            == driver.reservations[cache.buffer.base_ptr]
        )
        assert f["physical"] == f["mapped"] == cache.physical_bytes == driver.physical_bytes > 0
        assert f["committed"] == cache.num_committed_blocks == cache.min_committed_blocks
        assert (
            f["pool"].capacity_slots == cache.capacity_blocks == runner.kv_cache_config.num_blocks
        )
        assert f["pool"].slot_bytes == cache.bytes_per_block
        assert f["pool"].page_bytes == GRANULE
        reserved, tensor = f["reserved"], f["tensor"]
        blocks_bytes = cache.capacity_blocks * cache.bytes_per_block
        if layout == "BLNHC":  # one segment: the reservation rounds the allocation up
            assert blocks_bytes == tensor < reserved
        else:  # a segment per layer region, each padded to a granule
            assert blocks_bytes < tensor == reserved
        seen = [f["physical"]]

        def step(action, expect_blocks: int) -> dict[str, Any]:
            action()
            g = _figures(worker)
            assert g["physical"] == g["mapped"] == cache.physical_bytes == driver.physical_bytes
            assert g["committed"] == expect_blocks
            assert (g["reserved"], g["tensor"]) == (reserved, tensor)  # never move
            seen.append(g["physical"])
            return g

        grow = cache.capacity_blocks * 3 // 4
        g = step(lambda: ensure_kv_cache_blocks(runner, grow), grow)  # warm-up's commits
        assert g["physical"] > seen[0] and g["pool"].pages_mapped_total * GRANULE == g["physical"]
        assert g["pool"].map_seconds_total > 0  # the commit's own time
        small = cache.capacity_blocks // 8
        g = step(lambda: cache.commit(small, shrink=True), small)  # extend_kv_cache's shrink
        assert 0 < g["physical"] < seen[1]
        # The remap is an unmap of everything, then a map of the smaller prefix.
        assert g["pool"].pages_unmapped_total * GRANULE == seen[1]
        g = step(cache.release_physical, 0)  # sleep
        assert g["physical"] == 0 and driver.chunks == {}
        g = step(cache.recommit, small)  # wake-up
        assert g["physical"] == seen[2]
        g = step(lambda: cache.commit(cache.capacity_blocks + 10), cache.capacity_blocks)
        assert g["physical"] <= reserved

        # The file kvledger serve reads says the same.
        with Sources(snapdir) as sources:
            worker.publish_now()
            [view] = [v for v in sources.read().views if v.labels["engine_type"] == "vllm_worker"]
        fams = {fam.family: fam.figures for fam in view.summary.families}
        assert fams["kv_pool"].physical_bytes == cache.physical_bytes
        assert fams["kv_pool"].reserved_bytes == reserved
        path = worker.publisher.path
        assert os.path.exists(path)

        # vLLM frees the cache (its runner shuts down): the file and the accounts go.
        cache.free()
        assert hooks.worker_ledger() is None and worker.closed
        assert not os.path.exists(path)
        assert worker.ledger.accounts() == ()
        assert driver.leaks() == {}


def test_the_profiling_cache_is_not_registered(snapdir, monkeypatch, v2) -> None:
    with host_vmm(monkeypatch) as driver:
        _, config, runner = _setup(monkeypatch, v2)
        assert hooks.install()
        v2.initialize_kv_cache(runner, config, True, extensible=True)
        assert hooks.worker_ledger() is None
        runner.extensible_kv_cache.free()
        assert driver.leaks() == {}


def test_a_cache_collected_unfreed_reads_zero(snapdir, monkeypatch, v2) -> None:
    import gc

    with host_vmm(monkeypatch) as driver:
        _, config, runner = _setup(monkeypatch, v2)
        assert hooks.install()
        v2.initialize_kv_cache(runner, config, extensible=True)
        worker = hooks.worker_ledger()
        assert _figures(worker)["physical"] > 0
        # A re-initialisation drops the old cache without free(); kvledger holds it weakly.
        runner.extensible_kv_cache = runner.kv_caches_by_layer = None
        for layer in runner.compilation_config.static_forward_context.values():
            layer.kv_cache = None
        gc.collect()
        assert driver.leaks() == {}  # vLLM's own __del__ freed it: kvledger kept nothing alive
        f = _figures(worker)
        assert (f["physical"], f["committed"]) == (0, 0)


def test_without_the_extensible_cache_the_storage_is_as_before(snapdir, monkeypatch, v2) -> None:
    """0.34 with --no-enable-extensible-kv-cache: one int8 storage, tensor = reserved =
    physical, as 0.33's V1 runner."""
    cfg = runner_v2.vllm_config()
    config = vs.kv_cache_config(cfg, vs.full_specs(4), 8 * MIB)
    runner = runner_v2.runner(cfg, config, "cpu")
    assert hooks.install()
    v2.initialize_kv_cache(runner, config)
    worker = hooks.worker_ledger()
    snap = worker.ledger.snapshot(reconcile=False)
    assert not snap.violations
    [pool] = [b for b in snap.buffers if b.spec.family == "kv_pool"]
    storage = next(iter(runner.kv_caches_by_layer.values())).untyped_storage().nbytes()
    assert pool.spec.owner is Owner.RUNTIME
    assert pool.spec.tensor_bytes == pool.spec.reserved_bytes == pool.physical_bytes == storage
    assert "kv_pool_committed" not in {a.family for a in snap.accounts}


# -- what the exporter and the GPU breakdown make of it ----------------------------------
def test_the_worker_view_and_the_gpu_parts(snapdir, monkeypatch, v2) -> None:
    from accounting.gpu_parts import Baseline, Readings, TorchMemory, parts_of
    from accounting.nvml import runtime_physical_bytes
    from accounting.reconcile import vmm_physical_bytes
    from kvledger.engines.vllm.views import worker_of

    with host_vmm(monkeypatch):
        _, config, runner = _setup(monkeypatch, v2)
        assert hooks.install()
        v2.initialize_kv_cache(runner, config, extensible=True)
        cache = runner.extensible_kv_cache
        cache.commit(cache.capacity_blocks // 2)
        worker = hooks.worker_ledger()
        with Sources(snapdir) as sources:
            worker.publish_now()
            [view] = [v for v in sources.read().views if v.labels["engine_type"] == "vllm_worker"]
            w = worker_of(view.published)
        assert w.physical_bytes == cache.physical_bytes
        assert w.reserved_bytes == cache.buffer.capacity_bytes and w.tensor_bytes == cache.size
        assert (w.blocks, w.committed_blocks) == (cache.capacity_blocks, cache.num_committed_blocks)
        assert w.block_bytes == cache.bytes_per_block
        assert {g.kind for g in w.groups} == {"full_attention", "sliding_window"}
        assert all(g.physical_bytes == cache.physical_bytes for g in w.groups)

        # The GPU breakdown: the committed granules are VMM mappings outside torch's
        # allocator; counted as kv, they are not outside_torch.
        snap = worker.ledger.snapshot(reconcile=False)
        vmm = vmm_physical_bytes(snap)
        assert vmm == cache.physical_bytes and runtime_physical_bytes(snap) == 0
        torch_mem = TorchMemory(reserved_bytes=300 * MIB, allocated_bytes=250 * MIB)
        context = 500 * MIB
        process = torch_mem.physical_bytes + vmm + context
        parts = parts_of(
            Readings(
                device_used=process,
                process_used=process,
                torch=torch_mem,
                weights_bytes=200 * MIB,
                kv_bytes=snap.total("physical_bytes"),
                kv_torch_bytes=runtime_physical_bytes(snap),
                vmm_bytes=vmm,
                baseline=Baseline(
                    device_used=context, process_used=context, torch_physical=0, vmm_bytes=0
                ),
            )
        )
        assert parts["kv"] == cache.physical_bytes
        assert parts["outside_torch"] == context
        assert parts["activations"] == 50 * MIB and parts["unattributed"] == 0


@pytest.mark.slow
def test_the_debug_page_says_how_much_of_the_reservation_is_backed(snapdir, monkeypatch, v2):
    """/debug/kv's HTML, read by Chromium: the worker line of an extensible cache says how
    many blocks are backed now and the physical against the reserved bytes."""
    from exporter import html
    from exporter.app import create_app
    from kvledger.engines.exports import register_all
    from tests import browser
    from tests.servers import UvicornThread

    if not browser.available():
        pytest.skip("needs Debian's chromium")
    register_all()  # as `kvledger serve` does: vLLM's sources served in their own shape
    with host_vmm(monkeypatch):
        _, config, runner = _setup(monkeypatch, v2)
        assert hooks.install()
        v2.initialize_kv_cache(runner, config, extensible=True)
        cache = runner.extensible_kv_cache
        cache.commit(cache.capacity_blocks // 4)
        hooks.worker_ledger().publish_now()
        with (
            Sources(snapdir) as sources,
            UvicornThread(create_app(sources, debug_html=html.page)) as server,
        ):
            parsed = browser.parse(browser.dump_dom(f"{server.url}/debug/kv"))
    [line] = [e for e in parsed.elements if "data-committed-blocks" in e]
    assert int(line["data-committed-blocks"]) == cache.num_committed_blocks > 0
    text = " ".join(parsed.text)
    backed = f"{cache.num_committed_blocks:,} of them backed now"
    assert backed in text, text[:2000]
    assert "reserved)" in text
