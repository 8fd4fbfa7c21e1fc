"""DeepSeek-V4's per-layer KV specs as vLLM 0.33's model declares them, without building the
model (its attention layer needs CUDA: `torch.cuda.Event()` in
`DeepseekV4Attention.__init__`, `vllm/models/deepseek_v4/attention.py`).

A DeepSeek-V4 decoder layer `i` (compress ratio `r`, from the config's `layer_types` and
`compress_rates`) declares, in vLLM 0.33:

| cache | vLLM class (built here for real) | when |
|---|---|---|
| the SWA cache | `DeepseekV4SWACache` (`vllm/v1/attention/backends/mla/sparse_swa.py`) | every layer |
| the compressed MLA cache | `DeepseekV4Attention.get_kv_cache_spec`, called on the four fields it reads | r > 1 |
| the compressor's state | `CompressorStateCache` (`vllm/models/deepseek_v4/compressor.py`) | r > 1 |
| the indexer's K cache | `DeepseekV4IndexerCache` (`attention.py`) | r = 4 |
| the indexer compressor's state | `CompressorStateCache` | r = 4 |

The cache layers are vLLM's own classes, constructed on the CPU (they hold no weights);
only the attention layer's own spec is asked of vLLM's method on a stand-in carrying what
its constructor would set: `head_dim`, `compress_ratio`, and the KV dtype pair from vLLM's
`_resolve_dsv4_kv_cache_dtype`. What this mirrors of the constructors, and so what a
later vLLM could change under it: the ratio per layer (`max(1, compress_rates[type])`),
the state dims (`2 * coff * head_dim`, `coff = 2` for ratio 4 else 1; the indexer's
compressor on `index_head_dim`), the indexer K cache's row (`index_head_dim +
index_head_dim / 128 * 4` bytes in FP8; MXFP4 when vLLM's `dsa_indexer_uses_fp4` says so)
and which of those backends the layers use. The attention backend's class attributes
(`use_fp8_ds_mla_layout`, `backend_cls`, `swa_backend_cls` of
`vllm/models/deepseek_v4/nvidia/flashmla.py` or `flashinfer_sparse.py`) are read, not
mirrored: FlashMLA (fp8_ds_mla) is what vLLM runs on Hopper. The KV layouts the
worker would report come from those backends through vLLM's
`get_supported_kv_cache_layouts`. MTP (speculative) layers are not included.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

MODEL_TYPES = ("deepseek_v4",)
INDEXER_QUANT_BLOCK = 128  # DeepseekV4Indexer.quant_block_size in vLLM 0.33


def is_deepseek_v4(hf: dict[str, Any]) -> bool:
    return str(hf.get("model_type", "")) in MODEL_TYPES


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}.self_attn"


BACKENDS = ("flashmla", "flashinfer")


def attention_class(backend: str) -> Any:
    """vLLM's DeepSeek-V4 attention class for an NVIDIA backend (its class attributes say
    the layout and the backends; it is never instantiated here)."""
    if backend == "flashmla":
        from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

        return DeepseekV4FlashMLAAttention
    if backend == "flashinfer":
        from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
            DeepseekV4FlashInferMLAAttention,
        )

        return DeepseekV4FlashInferMLAAttention
    raise ValueError(f"backend={backend!r}, expected one of {', '.join(BACKENDS)}")


def deepseek_v4_specs(cfg: Any, *, backend: str = "flashmla") -> tuple[dict[str, Any], list[str]]:
    """(layer name -> vLLM KVCacheSpec for every KV cache of a DeepSeek-V4 model, the KV
    cache layouts its backends support, most preferred first) for the VllmConfig `cfg`
    (vLLM's EngineArgs for the model's config) and an NVIDIA attention backend: FlashMLA
    (vLLM's choice on Hopper, fp8_ds_mla layout) or FlashInfer (plain rows)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerBackend,
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    attn = attention_class(backend)
    hf = cfg.model_config.hf_config
    cache_config = cfg.cache_config
    kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
        bool(attn.use_fp8_ds_mla_layout), cache_config.cache_dtype, cache_config
    )
    index_row = _indexer_row(cfg, int(hf.index_head_dim))

    def state_cache(head_dim: int, ratio: int, prefix: str) -> Any:
        """A compressor's state rows (the attention's or the indexer's), fp32."""
        return CompressorStateCache(
            state_dim=2 * _coff(ratio) * head_dim,
            dtype=torch.float32,
            compress_ratio=ratio,
            prefix=prefix,
        )

    specs: dict[str, Any] = {}
    with set_current_vllm_config(cfg):
        for i in range(int(hf.num_hidden_layers)):
            p = layer_prefix(i)
            ratio = max(1, int(hf.compress_rates.get(hf.layer_types[i], 0)))
            swa = DeepseekV4SWACache(
                head_dim=hf.head_dim,
                window_size=hf.sliding_window,
                dtype=kv_torch_dtype,
                prefix=f"{p}.swa_cache",
                cache_config=cache_config,
                backend_cls=attn.swa_backend_cls,
            )
            specs[swa.prefix] = swa.get_kv_cache_spec(cfg)
            if ratio <= 1:
                continue
            stand_in = SimpleNamespace(
                compress_ratio=ratio,
                head_dim=hf.head_dim,
                kv_cache_dtype=kv_dtype,
                kv_cache_torch_dtype=kv_torch_dtype,
            )
            specs[p] = DeepseekV4Attention.get_kv_cache_spec(stand_in, cfg)
            state = state_cache(int(hf.head_dim), ratio, f"{p}.compressor.state_cache")
            specs[state.prefix] = state.get_kv_cache_spec(cfg)
            if ratio != 4:
                continue
            k_cache = DeepseekV4IndexerCache(
                head_dim=index_row,
                dtype=torch.uint8,
                prefix=f"{p}.indexer.k_cache",
                cache_config=cache_config,
                compress_ratio=ratio,
            )
            specs[k_cache.prefix] = k_cache.get_kv_cache_spec(cfg)
            istate = state_cache(
                int(hf.index_head_dim), ratio, f"{p}.indexer.compressor.state_cache"
            )
            specs[istate.prefix] = istate.get_kv_cache_spec(cfg)
    backends = [attn.backend_cls, attn.swa_backend_cls, CompressorBackend, DeepseekV4IndexerBackend]
    return specs, [layout.name for layout in get_supported_kv_cache_layouts(backends)]


def _coff(ratio: int) -> int:
    return 1 + (ratio == 4)  # DeepseekCompressor: overlapping windows for ratio 4


def _indexer_row(cfg: Any, head_dim: int) -> int:
    """Bytes of one indexer K row, as DeepseekV4Indexer sizes its K cache."""
    from vllm.models.deepseek_v4.attention import MXFP4_BLOCK_SIZE, dsa_indexer_uses_fp4

    if dsa_indexer_uses_fp4(cfg):
        return head_dim // 2 + head_dim // MXFP4_BLOCK_SIZE
    return head_dim + head_dim // INDEXER_QUANT_BLOCK * 4
