"""Which vLLM kvledger accepts: classes that offer what it reads, whatever the version says;
one line when not. (vLLM 0.34's V2-only runner: tests/kvledger/engines/vllm/v034.)"""

from __future__ import annotations

import logging

import pytest

from kvledger.engines.vllm import compat, hooks

pytestmark = pytest.mark.vllm


def _ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("kvledger")]


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("KVLEDGER_VLLM_REQUIRE", raising=False)
    yield
    hooks.uninstall()


def test_vllm_0_33_is_accepted_quietly(clean, caplog) -> None:
    import vllm

    assert vllm.__version__.startswith("0.33.")
    with caplog.at_level(logging.WARNING, logger="kvledger.engines.vllm.compat"):
        assert compat.check() == ""
    assert _ours(caplog) == []


def test_another_version_whose_classes_match_is_accepted_with_one_warning(
    clean, monkeypatch, caplog
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.1")
    with caplog.at_level(logging.WARNING, logger="kvledger.engines.vllm.compat"):
        assert compat.check() == ""
    [message] = _ours(caplog)
    assert "vLLM 0.35.1 is none of 0.32, 0.33, 0.34" in message


def test_a_build_without_what_kvledger_reads_is_refused_in_one_line(
    clean, monkeypatch, caplog
) -> None:
    import vllm
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(vllm, "__version__", "0.35.1")
    monkeypatch.delattr(BlockPool, "evict_blocks")
    why = compat.check()
    assert "\n" not in why
    assert why.startswith("vLLM 0.35.1: kvledger reads the KV classes of vLLM 0.32, 0.33, 0.34")
    assert "BlockPool.evict_blocks" in why and why.endswith("kvledger is off")
    # The plugin stays off (vLLM untouched), saying so once; required, it raises.
    original = GPUModelRunner.initialize_kv_cache_tensors
    with caplog.at_level(logging.WARNING, logger="kvledger.engines.vllm.hooks"):
        assert hooks.install() == []
    assert GPUModelRunner.initialize_kv_cache_tensors is original
    assert _ours(caplog) == [f"kvledger: {why}"]
    monkeypatch.setenv("KVLEDGER_VLLM_REQUIRE", "1")
    with pytest.raises(RuntimeError, match=r"BlockPool\.evict_blocks"):
        hooks.install()


def test_a_missing_config_field_is_named(clean, monkeypatch) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    fields = dict(KVCacheConfig.__dataclass_fields__)
    del fields["kv_cache_groups"]
    monkeypatch.setattr(KVCacheConfig, "__dataclass_fields__", fields)
    assert "KVCacheConfig.kv_cache_groups" in compat.check()


def test_the_v1_runner_is_hooked_where_it_exists(clean) -> None:
    """0.33 has the V1 runner: its initialize_kv_cache_tensors is hooked (first); the V2
    runner too where its initialize_kv_cache fits (a worker builds one of the two)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvledger.engines.vllm.patch import is_patched

    hooks_ = compat.worker_hooks()
    assert hooks_[0].name == "v1" and hooks_[0].cls is GPUModelRunner
    targets = {p.target for p in hooks.install()}
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors" in targets
    assert is_patched(GPUModelRunner, "initialize_kv_cache_tensors")
