"""vLLM 0.34's V2 runner, as far as its KV cache goes, on a CPU.

`GPUModelRunner.initialize_kv_cache` (`vllm/v1/worker/gpu/model_runner.py`) also builds the
attention backends, block tables and CUDA-graph manager, which a CPU cannot; its KV part is
a few of vLLM's own calls, made here in the same order on vLLM's own objects:
`ExtensibleKVCache(...)` when `extensible`, `init_kv_cache(..., allocate=cache.allocate)`
(vLLM's `allocate_kv_cache` and `bind_kv_caches`), then `kv_caches` and, unless profiling,
`kv_caches_by_layer`. The worker's other calls on the cache are vLLM's own functions
(`ensure_kv_cache_blocks`, `ExtensibleKVCache.commit` / `release_physical` / `recommit` /
`free`), called on the real objects by the tests.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from copy import deepcopy
from types import SimpleNamespace
from typing import Any

from tests.kvledger.engines.vllm import vllm_setup as vs


def initialize_kv_cache(
    self: Any,
    kv_cache_config: Any,
    is_profiling: bool = False,
    kv_cache_allocation_context: AbstractContextManager[Any] | None = None,
    extensible: bool = False,
) -> None:
    """The KV part of vLLM 0.34's `GPUModelRunner.initialize_kv_cache` (same signature)."""
    from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache

    kv_cache_config = deepcopy(kv_cache_config)
    self.kv_cache_config = kv_cache_config
    self.extensible_kv_cache = None
    if extensible:
        self.extensible_kv_cache = ExtensibleKVCache(
            kv_cache_config, self.device, self.cache_config.get_resolved_kv_cache_layout()
        )
    allocate_fn = None
    if self.extensible_kv_cache is not None:
        allocate_fn = self.extensible_kv_cache.allocate
    kv_caches_dict = init_kv_cache(
        self.compilation_config.static_forward_context,
        self.kv_cache_config,
        self.device,
        self.kernel_block_sizes,
        self.vllm_config,
        kv_cache_allocation_context=kv_cache_allocation_context,
        allocate=allocate_fn,
    )
    self.kv_caches = [c for c in kv_caches_dict.values() if c.device == self.device]
    if not is_profiling:
        self.kv_caches_by_layer = kv_caches_dict


def vllm_config(**engine: Any) -> Any:
    """`vllm_setup.vllm_config` on vLLM 0.34's CPU platform, which refuses to build a config
    on an x86 CPU without Triton's CPU backend ("vLLM on x86 CPUs requires Triton",
    `CpuPlatform.check_and_update_config`); the CUDA wheel installed with --no-deps has none.
    Nothing runs a model here, so vLLM is told Triton is there while the config is built,
    and only then: the modules whose kernels look at it are imported before."""
    import vllm.triton_utils
    import vllm.v1.worker.extensible_kv_cache
    import vllm.v1.worker.gpu.model_runner

    saved = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        return vs.vllm_config(**engine)
    finally:
        vllm.triton_utils.HAS_TRITON = saved


def runner(cfg: Any, config: Any, device: str) -> Any:
    """A V2 GPUModelRunner carrying what the KV part reads."""
    import torch

    return SimpleNamespace(
        vllm_config=cfg,
        device=torch.device(device),
        cache_config=cfg.cache_config,
        kernel_block_sizes=None,
        compilation_config=SimpleNamespace(
            static_forward_context={
                n: vs.Layer() for g in config.kv_cache_groups for n in g.layer_names
            }
        ),
    )


def padded(cfg: Any, config: Any, granule: int) -> Any:
    """The worker's config as `GPUWorker.initialize_from_config` hands it on with the
    extensible cache: every layer's region starting on a granule."""
    from vllm.v1.worker.extensible_kv_cache import pad_kv_cache_segments

    return pad_kv_cache_segments(config, cfg.cache_config.get_resolved_kv_cache_layout(), granule)
