"""vLLM 0.33 objects built for real on the CPU: a VllmConfig for a small HF config, the
per-layer KV specs such a model declares, vLLM's own KVCacheConfig for them, and the
worker's KV tensors as `allocate_kv_cache` (what `initialize_kv_cache_tensors` calls)
builds them."""

from __future__ import annotations

import json
import os
import tempfile
from types import SimpleNamespace
from typing import Any

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
BLOCK = 16


def vllm_config(hf: dict[str, Any] | None = None, **engine: Any) -> Any:
    """A real VllmConfig (vLLM's EngineArgs) for an HF config written to a temp dir."""
    from vllm.engine.arg_utils import EngineArgs

    d = tempfile.mkdtemp(prefix="kvledger-vllm-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf or LLAMA, f)
    args = dict(skip_tokenizer_init=True, load_format="dummy", max_model_len=1024, block_size=BLOCK)
    args.update(engine)
    return EngineArgs(model=d, **args).create_engine_config()


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def full_specs(n: int = 4, start: int = 0) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {
        layer(i): FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
        )
        for i in range(start, start + n)
    }


def sliding_specs(n: int = 4, start: int = 4) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return {
        layer(i): SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
        )
        for i in range(start, start + n)
    }


def kv_cache_config(cfg: Any, specs: dict[str, Any], memory: int) -> Any:
    """vLLM's own KVCacheConfig for one worker with `memory` bytes for its KV cache."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    # What the engine core does first (vllm/v1/engine/core.py); a GPU worker with
    # FlashAttention reports [L, B, N, H, C] first. Recorded on cache_config once.
    resolve_kv_cache_layout(cfg, [["LBNHC", "LBHNC"]], list(specs.values()))
    groups = get_global_kv_cache_groups(cfg, [specs])
    return get_kv_cache_configs(cfg, [specs], [memory], groups)[0]


def allocate(cfg: Any, config: Any) -> dict[str, Any]:
    """The worker's tensors, as `GPUModelRunner.initialize_kv_cache_tensors` allocates them
    (`vllm.v1.worker.utils.allocate_kv_cache`), on the CPU."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(config, torch.device("cpu"), layout, None)


def kind_of(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return str(get_kv_cache_spec_kind(spec).value)


class Layer:
    """A stand-in attention layer: what `bind_kv_cache` needs."""

    def bind_kv_cache(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache


def runner(cfg: Any, config: Any, device: str = "cpu") -> Any:
    """A GPUModelRunner carrying only what `initialize_kv_cache_tensors` reads."""
    return SimpleNamespace(
        vllm_config=cfg,
        device=device,
        cache_config=cfg.cache_config,
        shared_kv_cache_layers={},
        model_config=cfg.model_config,
        attn_groups=[],
        speculative_config=None,
        compilation_config=SimpleNamespace(
            static_forward_context={
                n: Layer() for g in config.kv_cache_groups for n in g.layer_names
            }
        ),
        kv_caches=[],
    )
